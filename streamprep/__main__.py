from streamprep.cli import entry

entry()
