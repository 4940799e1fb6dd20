"""Reports: data in, text out (console, HTML, SARIF, JUnit, JSON); nothing here runs an engine."""
