"""Experiment trackers: the Trainer's writers (CSV, TensorBoard, MLflow, wandb) and the Accelerator's ``log_with``
set, written on the main process only. Knows nothing of training; the training step's registry holds a set."""
