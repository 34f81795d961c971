from storage.cli import main

raise SystemExit(main())
