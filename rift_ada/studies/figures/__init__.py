"""The figures of experiments/reproduce_figures.py, one per module, each drawn from the run's shared evaluations
(``evaluations.EvaluationCache``) and returned as a ``figure.Figure`` (rows, markdown table, plot)."""

from . import al_by_budget, al_by_input_length, al_by_quarter, refresh_tradeoff, training_table

# In the paper's order: fig1 ... fig5.
FIGURES = (al_by_quarter.figure, al_by_budget.figure, al_by_input_length.figure, refresh_tradeoff.figure,
           training_table.figure)
