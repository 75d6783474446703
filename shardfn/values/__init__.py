"""Values: meshes, specs, layouts, errors and per-thread context; shapes only, no tensor math."""
