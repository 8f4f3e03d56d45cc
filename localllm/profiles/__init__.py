"""The tuning service around the planner: which plan the daemon loads (a saved profile, or the
tuner checked by dry-run loads), plans per fill band, saved profiles, measured acceptance and
KV quality, calibration, and the processes that measure them. It receives the live `Config`."""
