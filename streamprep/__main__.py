from streamprep.cli import main
import sys
sys.exit(main())
