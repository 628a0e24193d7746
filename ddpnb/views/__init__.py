"""The views of a run, in the kernel: the live dashboard (Jupyter) and plain text (everywhere else). Both read
the run through `Run.lines_since`, `Run.watch` and its record; neither reaches into its locks."""
