from vt.launch.cli import main

raise SystemExit(main())
