"""primus-cli: launch MegaMoE trainings directly, in containers, or on Slurm."""

__version__ = "0.1.0"
