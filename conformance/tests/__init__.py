"""The suite's tests, one folder per clause family, files named by the behaviour they check
(test ids are public: xfail files name them; ``conformance.plugin`` keeps a table of moved ids)."""
