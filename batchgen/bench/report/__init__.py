"""What a bench reports: per-request and per-step metrics, ceilings and rooflines, the table, JSON and plot."""
