"""Planning: how fast one replica runs and how many of them a load needs.

    speed.py        the speed model of one replica (decode step vs batch, prefill vs prompt), from
                    datasheet rooflines or fitted to measurements
    calibration.py  how the gateway keeps it true to the traffic it sees
    inputs.py       the planner's inputs (model shape, accelerator, deployment, traffic, SLOs)
    figures.py      one capacity figure with its rule; memory.py, fleet.py: the memory and fleet figures
    planner.py      the plan: memory budgets and replica counts of the prefill and decode pools
    view.py         the plan as tables, a walk through its arithmetic, or JSON

Admission and placement (pdcluster/services/gateway), the autoscaler
(pdcluster/services/autoscale) and `pdcluster plan` (pdcluster/services/cli/plan.py)
read the same model.  Pure: nothing here imports pdcluster.services or bench
(tests/unit/layout/test_layers.py); a model's files are read by
pdcluster/services/model_meta.py, and bench/plan profiles an endpoint."""
