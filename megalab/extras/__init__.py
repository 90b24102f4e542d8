"""What the course adds to teach and Megatron-LM has no file for: formulas, the planner, plots, toy collectives, projects."""
