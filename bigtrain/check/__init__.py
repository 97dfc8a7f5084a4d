"""Proof that a layout trains like one process: the independent reference, ``bigtrain check``'s
side-by-side run and bisection, and the seeded layout fuzzer."""
