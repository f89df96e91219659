"""Web-archive decisions that look across documents: one capture per page (captures.py) and each site's repeated
boilerplate lines (boilerplate.py), taken on key rows moved through keyed exchanges."""
