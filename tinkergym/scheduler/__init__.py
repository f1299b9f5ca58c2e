"""The scheduler service: jobs, GPU leases, workers, auth and the dashboard."""
