from qaccel.cli import main

raise SystemExit(main())
