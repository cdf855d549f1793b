"""Embedded tasks with gold attention, generated locally (nothing is downloaded at run time)."""
