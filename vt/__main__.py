from vt.cli import main

raise SystemExit(main())
