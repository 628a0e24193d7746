"""What every engine shares, in the kernel: the spec, the `Run`, its record, messages, pickling, run directories.
The core imports no engine, view or API module (import-linter checks it)."""
