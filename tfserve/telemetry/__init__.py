"""What a serving process tells its operator: Prometheus metrics (`metrics`) and log records
as JSON lines (`logs`). Used by the scheduler and every layer above it."""
