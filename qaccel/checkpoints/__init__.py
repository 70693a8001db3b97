"""Checkpoints: save_state/load_state of what an Accelerator prepared, written atomically and checked on reading,
and the background saves that write them while training goes on. Built on ``qaccel.train``'s registry."""
