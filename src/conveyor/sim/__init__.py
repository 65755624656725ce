"""The simulator: the real Scheduler driven by a SimulatedExecutor (``executor``) whose step
times come from a roofline cost model (``cost_model``) over hardware and model specs
(``specs``), on a virtual clock (``clock``), fed by seeded workloads or traces (``workload``);
``runner`` runs them, ``metrics`` / ``report`` / ``plots`` summarise, ``cli`` is
``conveyor simulate``.
No torch import anywhere in this package.
"""
