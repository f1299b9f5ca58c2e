"""Trainer plugins (entry-point group ``tinkergym.trainers``): one file per algorithm."""
