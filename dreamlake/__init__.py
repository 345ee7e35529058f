"""dreamlake: namespace for the lakeshore SDK, control plane and runtime."""
