"""Tools over the engine: benchmarks against peers, calibration, the will-it-fit estimate and
the model hub. Nothing on a reply's path imports them."""
