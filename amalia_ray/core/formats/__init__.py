"""The files one stage writes and another reads, one module per format, each with its row rule (`validate_*`: the
error, or None), a reader that applies it to every row and names the file and line of the first bad one, and a
writer that refuses a bad row rather than write a file its reader would reject: conversations (SFT), preference
pairs (DPO), tasks (on-policy sampling), and the packed token shards pretraining reads (shards.py)."""
