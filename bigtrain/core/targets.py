"""The target id that every loss leaves out (torch's cross-entropy default), shared by the data
that masks targets with it and the losses that skip them."""

IGNORE_INDEX = -100
