"""Tools around hora jobs: environment checks (``hora doctor``), and later timeline analysis."""
