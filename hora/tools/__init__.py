"""Tools around hora jobs: environment checks (``hora doctor``), timeline analysis
(``hora timeline``), benchmark studies (``hora bench``)."""
