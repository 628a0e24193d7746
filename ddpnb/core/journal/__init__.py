"""A run's journal: what its owner's attempts were told and what the owner decided, appended to a file in the run
directory, so that any later process replays it into the same record and views (docs/detached.md).

`frames`: the file (framed records, a header with the versions, a reader that stops at a torn record, a follower);
`entries`: what one record says; `tee`: the owner's side, which writes it; `replay`: a viewer's, which plays it.
"""

JOURNAL_FILE = "journal"  # its name in the run directory
JOURNAL_VAR = "DDPNB_JOURNAL"  # set (1): ordinary runs write a journal too (detached runs always do)
