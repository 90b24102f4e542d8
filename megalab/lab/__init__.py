"""The course machinery: the launcher and %%torchrun, exercises and grading, notebooks, workspaces, the CLI."""
