"""How fast one replica runs (model.py), and how the gateway keeps that
model true to the traffic it sees (calibration.py).  Admission, placement,
the planner (bench/plan) and the autoscaler read the same two models."""
