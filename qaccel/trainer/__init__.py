"""qadence's Trainer on qaccel: ``Trainer(model, optimizer, TrainConfig(nprocs=4)).fit(loader)``, with tracked
metrics, plots, callbacks and checkpoints. The top layer: built on the Accelerator like a user's own loop."""
