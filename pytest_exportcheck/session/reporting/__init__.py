"""What a run reports: the matrix and the JSON report (``_report``), the header
(``_header``), JUnit properties (``_junit``), local paths redacted (``_redact``), the
catalogue lines (``_catalogue``) and the shrunk failures kept on disk (``_failure_files``).
"""
