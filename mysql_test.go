package outbox_test

import (
	"bytes"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	gormmysql "gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// againAfterDeadlocks runs the transaction fn again while MySQL ends it
// for a deadlock (1213), as an application must: InnoDB picks a victim
// among transactions that insert the same new key, which PostgreSQL and
// SQLite make wait instead.
func againAfterDeadlocks(fn func() error) error {
	for {
		err := fn()
		var me *mysql.MySQLError
		if !errors.As(err, &me) || me.Number != 1213 {
			return err
		}
	}
}

// TestMySQLConnectionsKilledMidRun kills the connections of four writers
// and two dispatchers (KILL CONNECTION) every few hundred milliseconds for
// five seconds, and then checks what TestPostgresConnectionsTerminatedMidRun
// checks: every committed transaction's events delivered in order, none
// of a transaction that did not commit, no row left delivering. The
// victims are the test's own connections, known by the ids the server gave
// them when they connected.
func TestMySQLConnectionsKilledMidRun(t *testing.T) {
	t.Parallel()
	b := setup(t, outboxtest.MySQL, nil)
	ids := &connectionIDs{byRole: map[string]map[int64]bool{}}
	r := startFaultRunOn(t, b, 4, 2, func(_, role string, cfg *gorm.Config) *gorm.DB {
		return openTracked(t, b.info.DSN, role, ids, cfg)
	})
	var killed, rounds int
	byRole := map[string]int{}
	stop := time.Now().Add(5 * time.Second)
	for time.Now().Before(stop) {
		time.Sleep(150*time.Millisecond + rand.N(300*time.Millisecond))
		rounds++
		for _, c := range ids.take() {
			if b.db.Exec(`KILL CONNECTION `+strconv.FormatInt(c.id, 10)).Error == nil {
				killed++
				byRole[c.role]++
			}
		}
	}
	res := r.finish(t, 30*time.Second)
	summary(t, "connection faults (MySQL): %d connections killed in %d rounds (%d of writers, %d of dispatchers); %s",
		killed, rounds, byRole["writer"], byRole["dispatcher"], res)
	if byRole["writer"] == 0 || byRole["dispatcher"] == 0 {
		t.Errorf("killed %v connections: want both writers' and dispatchers'", byRole)
	}
}

// connectionIDs are the server's ids of the connections opened by role.
type connectionIDs struct {
	mu     sync.Mutex
	byRole map[string]map[int64]bool
}

func (c *connectionIDs) add(role string, id int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byRole[role] == nil {
		c.byRole[role] = map[int64]bool{}
	}
	c.byRole[role][id] = true
}

// connection is a server's id of a connection and the role it serves.
type connection struct {
	role string
	id   int64
}

// take hands out every id once: a killed connection does not come back.
func (c *connectionIDs) take() []connection {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []connection
	for role, ids := range c.byRole {
		for id := range ids {
			out = append(out, connection{role, id})
			delete(ids, id)
		}
	}
	return out
}

// openTracked opens a pool on dsn whose connections report their ids to
// ids under role.
func openTracked(t *testing.T, dsn, role string, ids *connectionIDs, cfg *gorm.Config) *gorm.DB {
	t.Helper()
	conf, err := mysql.ParseDSN(dsn)
	mustNil(t, err)
	base, err := mysql.NewConnector(conf)
	mustNil(t, err)
	pool := sql.OpenDB(trackedConnector{Connector: base, role: role, ids: ids})
	if cfg == nil {
		cfg = &gorm.Config{}
	}
	c := *cfg
	c.Logger = logger.Discard
	db, err := gorm.Open(gormmysql.New(gormmysql.Config{Conn: pool}), &c)
	mustNil(t, err)
	t.Cleanup(func() { pool.Close() })
	return db
}

// trackedConnector records the server's id of every connection it opens.
type trackedConnector struct {
	driver.Connector
	role string
	ids  *connectionIDs
}

func (c trackedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := conn.(driver.QueryerContext).QueryContext(ctx, `SELECT CONNECTION_ID()`, nil)
	if err != nil {
		conn.Close()
		return nil, err
	}
	v := make([]driver.Value, 1)
	err = rows.Next(v)
	rows.Close()
	if err != nil {
		conn.Close()
		return nil, err
	}
	text := fmt.Sprint(v[0])
	if b, ok := v[0].([]byte); ok {
		text = string(b)
	}
	id, err := strconv.ParseInt(text, 10, 64)
	if err != nil {
		conn.Close()
		return nil, err
	}
	c.ids.add(c.role, id)
	return conn, nil
}

// TestMySQLServerRestartMidRun restarts the MySQL server under four
// writers and two dispatchers: SIGTERM, a clean shutdown, then the same
// program started again with the same arguments (start-stop-daemon, as
// the machine starts it). It does not run in parallel with anything (no
// t.Parallel, here or in a subtest), keeps other processes' tests off the
// server while it is down (outboxtest.ExclusiveServer), waits for it to
// accept connections again, and skips when the machine does not allow the
// restart or the server it would restart is not the one OUTBOX_MYSQL_DSN
// names. The dispatchers must recover by themselves, with the guarantees
// of TestMySQLConnectionsKilledMidRun: every redelivery explained by a
// failed settle or a lost lease.
func TestMySQLServerRestartMidRun(t *testing.T) {
	mysqlServerRestartMidRun(t, syscall.SIGTERM)
}

// TestMySQLServerCrashMidRun does the same with SIGKILL, which is a
// crash: InnoDB recovers from its redo log at start. Unlike PostgreSQL's
// crash test, it allows no more redeliveries than a clean restart: the
// dispatchers' claims and settles commit like any other transaction, and
// the test skips unless the server makes every commit durable
// (innodb_flush_log_at_trx_commit = 1, and sync_binlog = 1 if it keeps a
// binary log), so the crash forgets nothing that committed.
func TestMySQLServerCrashMidRun(t *testing.T) {
	mysqlServerRestartMidRun(t, syscall.SIGKILL)
}

// restartMySQLEnv names the environment variable that allows tests to
// restart or crash the MySQL server they use: never by default, on a
// laptop's shared server.
const restartMySQLEnv = "OUTBOX_TEST_RESTART_MYSQL"

// mysqlServerRestartMidRun stops the server with sig under a fault run,
// starts it again, and checks the run.
func mysqlServerRestartMidRun(t *testing.T, sig syscall.Signal) {
	if os.Getenv(restartMySQLEnv) != "1" {
		t.Skipf("skipping: this test restarts the MySQL server; set %s=1 to run it (.ci/run does)", restartMySQLEnv)
	}
	name := map[syscall.Signal]string{syscall.SIGTERM: "SIGTERM", syscall.SIGKILL: "SIGKILL"}[sig]
	b := setup(t, outboxtest.MySQL, nil)
	sqlDB, err := b.db.DB()
	mustNil(t, err)
	srv := localMySQLServer(t, sqlDB, sig == syscall.SIGKILL)
	r := startFaultRunOn(t, b, 4, 2, func(_, _ string, cfg *gorm.Config) *gorm.DB {
		return outboxtest.Reopen(t, b.info, cfg)
	})
	time.Sleep(1500 * time.Millisecond)

	release := outboxtest.ExclusiveServer(t, outboxtest.MySQL, 2*time.Minute)
	pid := srv.running(t)
	// Whatever happens from here on, the server is left running.
	t.Cleanup(func() { srv.ensureRunning(t, pid) })
	began := time.Now()
	proc, err := os.FindProcess(pid)
	mustNil(t, err)
	mustNil(t, proc.Signal(sig))
	for !processGone(pid) {
		if time.Since(began) > time.Minute {
			t.Fatalf("the server (pid %d) is still running a minute after %s", pid, name)
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopped := time.Since(began)
	// Down for a second: writers and dispatchers meet refused
	// connections, not only broken ones.
	time.Sleep(time.Second)
	mustNil(t, srv.start())
	if !waitForMySQL(time.Minute) {
		t.Fatalf("the server does not accept connections a minute after it was started again")
	}
	upAgain := time.Since(began)
	release()

	uptime, err := mysqlUptime(sqlDB)
	mustNil(t, err)
	if uptime > time.Since(began)+time.Second {
		t.Skipf("skipping: the server OUTBOX_MYSQL_DSN names has been up %v: stopping process %d did not restart it", uptime, pid)
	}
	time.Sleep(1500 * time.Millisecond)
	res := r.finish(t, 30*time.Second)
	summary(t, "server %s (MySQL): %s stopped it in %v, it was started again a second later and accepted connections %v after the signal; %s",
		map[syscall.Signal]string{syscall.SIGTERM: "restart", syscall.SIGKILL: "crash"}[sig], name,
		stopped.Round(100*time.Millisecond), upAgain.Round(100*time.Millisecond), res)
}

// mysqlServer is the server behind OUTBOX_MYSQL_DSN, as a process on this
// machine.
type mysqlServer struct {
	db      *sql.DB // connected to it
	pidFile string
	// exe and args start it again: the running program and its
	// arguments.
	exe  string
	args []string
	// daemon is start-stop-daemon, which starts it detached from the test.
	daemon string
}

// localMySQLServer finds the process of the server db is connected to, or
// skips the test. The server names its pid file; the process in it must
// have been running as long as the server says it has. With durable, the
// server must also make every commit durable.
func localMySQLServer(t *testing.T, db *sql.DB, durable bool) *mysqlServer {
	t.Helper()
	var pidFile string
	var flushAtCommit, logBin, syncBinlog int
	mustNil(t, db.QueryRow(`SELECT @@pid_file, @@innodb_flush_log_at_trx_commit, @@log_bin, @@sync_binlog`).Scan(&pidFile, &flushAtCommit, &logBin, &syncBinlog))
	if durable && (flushAtCommit != 1 || logBin == 1 && syncBinlog != 1) {
		t.Skipf("skipping: the server does not make every commit durable (innodb_flush_log_at_trx_commit = %d, log_bin = %d, sync_binlog = %d), so a crash loses committed transactions by configuration",
			flushAtCommit, logBin, syncBinlog)
	}
	daemon, err := exec.LookPath("start-stop-daemon")
	if err != nil {
		t.Skip("skipping: start-stop-daemon is not installed, so the server cannot be started again from here")
	}
	s := &mysqlServer{db: db, pidFile: pidFile, daemon: daemon}
	pid := s.running(t)
	if s.exe, err = os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); err != nil || strings.HasSuffix(s.exe, " (deleted)") {
		t.Skipf("skipping: the program of the server's process %d cannot be started again (%q, %v)", pid, s.exe, err)
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	mustNil(t, err)
	if argv := strings.Split(strings.TrimSuffix(string(cmdline), "\x00"), "\x00"); len(argv) > 1 {
		s.args = argv[1:]
	}
	return s
}

// running returns the pid of the server's process, or skips the test when
// the pid file does not name, on this machine, a process as old as the
// server.
func (s *mysqlServer) running(t *testing.T) int {
	t.Helper()
	text, err := os.ReadFile(s.pidFile)
	if err != nil {
		t.Skipf("skipping: the server's pid file is not on this machine, so OUTBOX_MYSQL_DSN names a server elsewhere: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(text)))
	if err != nil {
		t.Skipf("skipping: the server's pid file %s holds %q, not a pid", s.pidFile, text)
	}
	uptime, err := mysqlUptime(s.db)
	mustNil(t, err)
	out, err := exec.Command("ps", "-o", "etimes=", "-p", strconv.Itoa(pid)).Output()
	if err != nil {
		t.Skipf("skipping: process %d, named by the server's pid file %s, does not run here: %v", pid, s.pidFile, err)
	}
	secs, err := strconv.Atoi(strings.TrimSpace(string(out)))
	mustNil(t, err)
	if age := time.Duration(secs) * time.Second; age < uptime-5*time.Second || age > uptime+5*time.Second {
		t.Skipf("skipping: process %d, named by the pid file %s, has run for %v, but the server OUTBOX_MYSQL_DSN names has been up %v: another server",
			pid, s.pidFile, age, uptime)
	}
	return pid
}

// start starts the server, detached from the test process (stdout and
// stderr go to /dev/null, so that no pipe of the test stays open in it);
// it does nothing if the program already runs.
func (s *mysqlServer) start() error {
	args := append([]string{"--start", "--oknodo", "--background", "--exec", s.exe, "--"}, s.args...)
	if err := exec.Command(s.daemon, args...).Run(); err != nil {
		return fmt.Errorf("%s %s: %w", s.daemon, strings.Join(args, " "), err)
	}
	return nil
}

// ensureRunning starts the server again if it does not answer, once the
// process pid has ended, and fails t if it still does not answer a minute
// later.
func (s *mysqlServer) ensureRunning(t *testing.T, pid int) {
	if waitForMySQL(2 * time.Second) {
		return
	}
	for deadline := time.Now().Add(time.Minute); !processGone(pid) && time.Now().Before(deadline); {
		time.Sleep(100 * time.Millisecond)
	}
	if err := s.start(); err != nil {
		t.Errorf("the server does not answer, and starting it again failed: %v", err)
		return
	}
	if !waitForMySQL(time.Minute) {
		t.Errorf("the server does not answer a minute after it was started again with %s --start --exec %s", s.daemon, s.exe)
	}
}

// processGone reports whether process pid has ended: it is gone, or a
// zombie its parent has not reaped yet.
func processGone(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command, which is in parentheses.
	i := bytes.LastIndexByte(stat, ')')
	return i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' || stat[i+2] == 'X'
}

// mysqlUptime returns how long the server db is connected to has been up.
func mysqlUptime(db *sql.DB) (time.Duration, error) {
	var name string
	var secs int64
	if err := db.QueryRow(`SHOW GLOBAL STATUS LIKE 'Uptime'`).Scan(&name, &secs); err != nil {
		return 0, fmt.Errorf("server uptime: %w", err)
	}
	return time.Duration(secs) * time.Second, nil
}

// waitForMySQL waits until a fresh connection to the test server answers.
func waitForMySQL(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		db, err := sql.Open("mysql", outboxtest.MySQLDSN())
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			err = db.PingContext(ctx)
			cancel()
			db.Close()
			if err == nil {
				return true
			}
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
}
