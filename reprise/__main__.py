from reprise.cli import main

raise SystemExit(main())
