"""The tests' infrastructure, not tests: running scripts and launchers in fresh processes and checking what they
leave (procs), the real components some tests need (component: SLURM, two hosts, a small disk; slurm_cluster: a
private SLURM), and the real training script's runs (real_train)."""
