"""Getting fn to run on every rank and its result back: where the process runs, starting ranks in a plain launch
(the caller's side and the inside of a rank), running in place under torchrun and srun, the settings and output
ranks inherit, run directories, failure records and launcher reports."""
