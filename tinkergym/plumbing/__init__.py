"""The standard-library pieces every part of tinkergym runs through: folders written whole (:mod:`.folders`), files
downloaded whole and checked (:mod:`.downloads`), URLs checked before anything connects (:mod:`.urls`), a run's
timeline of spans (:mod:`.timeline`), and the ``pip install`` that gets a missing piece here (:mod:`.install`). Each
imports nothing of the project but its errors."""
