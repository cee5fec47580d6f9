"""The stages of experiments/train_controller.py, each a function of explicit inputs that stores its finished units in
the job's state (``rift_ada.resume``): ``stages`` (costs, collect, fit, learn, sweep) and ``report`` (the
tradeoff table, plots, metrics, W&B and the printed summary)."""
