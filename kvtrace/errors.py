"""One exception type per kind of user mistake; each message says what to do."""


class KvtraceError(Exception):
    """Base class: the CLI prints the message and exits with ``exit_code``."""

    exit_code = 1


class UsageError(KvtraceError):
    """The command line or the configuration asks for something kvtrace cannot do (exit code 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """A setting (environment variable or option) has a value kvtrace cannot use."""


class BadSetting(ConfigError):
    """A ``KVTRACE_*`` / ``OTEL_*`` variable is not a value of its kind (number, range, choice)."""


class BadEndpoint(ConfigError):
    """The URL an exporter would send spans to is not one it can use."""


class UnwritableDirectory(ConfigError):
    """A directory kvtrace must write to (data home, spool) cannot be written."""


class DatabaseUnreachable(KvtraceError):
    """The ClickHouse URL is wrong or the server does not answer."""


class DatabaseBusy(KvtraceError):
    """The embedded (chDB) database is open in another process."""


class UnknownQuery(UsageError):
    """``kvtrace query NAME`` names no saved query."""


class QueryParameterError(UsageError):
    """A saved query's parameter is missing or malformed."""


class UnknownRun(KvtraceError):
    """A run id that the database does not hold."""


class SchemaMissing(KvtraceError):
    """The database has no kvtrace tables yet."""


class SchemaUpgradeFailed(KvtraceError):
    """A statement that creates or upgrades the kvtrace schema failed (rights, a server problem)."""


class EngineFailed(KvtraceError):
    """An engine process crashed or hung during one of kvtrace's own runs (experiment, demo)."""


class UnusableInput(UsageError):
    """An input path that names nothing kvtrace can read spans from (missing, a device, a FIFO)."""


class UnreadableInput(KvtraceError):
    """An input path that exists but cannot be read (permissions, an I/O error)."""


class IngestStopped(KvtraceError):
    """The database stopped accepting spans (full disk, lost connection); what was stored is kept."""

    report = None
    """The ``IngestReport`` of what was done before stopping, when ingest got that far."""
