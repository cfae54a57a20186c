"""Ways to start a job: sbatch templates, submitit, and plain local processes."""
