"""Private implementation modules of attnref; import from :mod:`attnref` instead."""
