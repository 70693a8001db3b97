"""What runs inside the training function: preparing models, optimizers and loaders, batches, the step,
precision, sharding, stopping on a signal, seeding, progress. Built on ``qaccel.comm``."""
