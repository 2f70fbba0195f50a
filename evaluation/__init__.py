"""evaluation/: what a policy is measured by at every evaluation -- success on both splits (evaluate.py), the
env's own probe (the household habit, habit.py) and the self-analysis probe (self_analysis.py)."""
