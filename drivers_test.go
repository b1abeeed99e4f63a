package outbox_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// drivers are the import paths of the database drivers (and the GORM
// dialectors that bring them in) that a program links only if it imports
// them itself.
var drivers = []string{
	"github.com/mattn/go-sqlite3",
	"github.com/glebarez/",
	"modernc.org/sqlite",
	"github.com/go-sql-driver/mysql",
	"github.com/jackc/pgx/",
	"github.com/lib/pq",
	"gorm.io/driver/",
}

// goTool returns the go command, or skips t where there is none.
func goTool(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("the go command is not on PATH (%v): the build checks need it", err)
	}
	return path
}

// deps returns the packages that pkg depends on, as go list -deps reports
// them for the environment env adds to this process's.
func deps(t *testing.T, pkg string, env ...string) []string {
	t.Helper()
	cmd := exec.Command(goTool(t), "list", "-deps", pkg)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v\n%s", pkg, err, stderrOf(err))
	}
	return strings.Fields(string(out))
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// linkedDrivers returns the packages of pkgs that are database drivers,
// but for those whose path starts with one of allowed.
func linkedDrivers(pkgs []string, allowed ...string) []string {
	var found []string
	for _, p := range pkgs {
		for _, d := range drivers {
			if strings.HasPrefix(p, d) && !hasAnyPrefix(p, allowed) {
				found = append(found, p)
				break
			}
		}
	}
	return found
}

func hasAnyPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

func TestRootImportsNoDriver(t *testing.T) {
	for _, env := range [][]string{nil, {"CGO_ENABLED=0"}} {
		if found := linkedDrivers(deps(t, ".", env...)); len(found) > 0 {
			t.Errorf("with %v the root package depends on database drivers a program may not use: %v", env, found)
		}
	}
}

// TestSingleEngineProgramsBuildWithoutCgo builds a program per server
// engine that imports only that engine's GORM driver, with CGO_ENABLED=0,
// checks that it links no other engine's driver, and runs it: it
// migrates, writes an event and delivers it.
func TestSingleEngineProgramsBuildWithoutCgo(t *testing.T) {
	goCmd := goTool(t)
	for _, tc := range []struct {
		engine  outboxtest.Engine
		program string
		allowed []string // the drivers the program imports itself
	}{
		{outboxtest.Postgres, "./testdata/nocgo/postgres", []string{"gorm.io/driver/postgres", "github.com/jackc/pgx/"}},
		{outboxtest.MySQL, "./testdata/nocgo/mysql", []string{"gorm.io/driver/mysql", "github.com/go-sql-driver/mysql"}},
	} {
		t.Run(string(tc.engine), func(t *testing.T) {
			t.Parallel()
			if found := linkedDrivers(deps(t, tc.program, "CGO_ENABLED=0"), tc.allowed...); len(found) > 0 {
				t.Errorf("%s links drivers it does not import: %v", tc.program, found)
			}
			bin := filepath.Join(t.TempDir(), "program")
			build := exec.Command(goCmd, "build", "-o", bin, tc.program)
			build.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := build.CombinedOutput(); err != nil {
				t.Fatalf("CGO_ENABLED=0 go build %s: %v\n%s", tc.program, err, out)
			}
			_, info := outboxtest.Open(t, tc.engine, nil)
			// Its standard output; the outbox's warnings about the
			// server's settings go to standard error.
			var stderr strings.Builder
			run := exec.Command(bin, info.DSN)
			run.Stderr = &stderr
			out, err := run.Output()
			if err != nil {
				t.Fatalf("%s: %v\n%s%s", tc.program, err, out, stderr.String())
			}
			if got, want := strings.TrimSpace(string(out)), "delivered 1: greeting.sent"; got != want {
				t.Errorf("%s printed %q, want %q", tc.program, got, want)
			}
		})
	}
}

// nestedModuleTest runs go vet and go test on every package of the module
// in dir, with env added to this process's environment, and fails t with
// their output if either fails.
func nestedModuleTest(t *testing.T, dir string, env []string, testFlags ...string) {
	t.Helper()
	goCmd := goTool(t)
	for _, args := range [][]string{{"vet", "./..."}, append(append([]string{"test"}, testFlags...), "./...")} {
		cmd := exec.Command(goCmd, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("in %s, go %s: %v\n%s", dir, strings.Join(args, " "), err, out)
		}
		t.Logf("in %s, go %s:\n%s", dir, strings.Join(args, " "), out)
	}
}

// TestPureGoSQLiteModule runs the tests of compat/puresqlite, a module of
// its own: the outbox on SQLite through the pure-Go
// github.com/glebarez/sqlite, built with CGO_ENABLED=0 (write, delivery,
// rollback, idempotency key, a value SQLite refuses). Its test binary
// links no cgo SQLite driver.
func TestPureGoSQLiteModule(t *testing.T) {
	t.Parallel()
	dir := filepath.Join("compat", "puresqlite")
	cmd := exec.Command(goTool(t), "list", "-deps", "-test", "./...")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps -test in %s: %v\n%s", dir, err, stderrOf(err))
	}
	if found := linkedDrivers(strings.Fields(string(out)), "github.com/glebarez/", "modernc.org/sqlite"); len(found) > 0 {
		t.Errorf("the pure-Go SQLite tests link other drivers: %v", found)
	}
	nestedModuleTest(t, dir, []string{"CGO_ENABLED=0"})
}

// TestMigrationToolsModule runs the tests of compat/migrationtools, a
// module of its own: outbox.Migrations applied with golang-migrate and
// goose on every engine, and AutoMigrate and the tools agreeing on what
// applied.
func TestMigrationToolsModule(t *testing.T) {
	t.Parallel()
	var flags []string
	if raceEnabled {
		flags = append(flags, "-race")
	}
	nestedModuleTest(t, filepath.Join("compat", "migrationtools"), nil, flags...)
}
