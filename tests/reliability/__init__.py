"""The reliability suite: faults and bad inputs that a run must survive, or end with a clear error."""
