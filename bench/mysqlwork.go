package main

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	mysqldriver "github.com/go-sql-driver/mysql"
)

// The work a MySQL drain asks of the server, counted as on PostgreSQL
// (work.go) where the engine allows, on the connections the drain opens
// (a network of their own, registered with the driver, wraps each one):
//
//   - statements and round trips, counted on the client from the
//     commands the driver writes: a statement is a COM_QUERY (text) or a
//     COM_STMT_EXECUTE (prepared); a round trip is any command that waits
//     for the server's answer, a COM_STMT_PREPARE among them, which
//     go-sql-driver sends before each statement with arguments unless the
//     DSN sets interpolateParams (the raw loop and the outbox share the
//     DSN); COM_STMT_CLOSE goes out with the next command. Prepares are
//     counted on their own too (detail);
//   - transactions, counted on the client: a COMMIT or ROLLBACK ends one,
//     and so does each statement sent outside START TRANSACTION ... COMMIT
//     (autocommit), but for the SET TRANSACTION that go-sql-driver sends
//     before START TRANSACTION to set the isolation level. On the server,
//     MariaDB has no count of transactions by session: the table shows
//     Handler_commit + Handler_rollback, the engine's commits, which are
//     one per statement that touches a table plus one per COMMIT;
//   - rows written: Handler_write + Handler_update + Handler_delete, the
//     rows the sessions inserted, updated and deleted in tables (rows of
//     the internal temporary tables that joins, derived tables and sorts
//     use count as Handler_tmp_write and Handler_tmp_update, detail);
//   - redo log bytes: how far Innodb_lsn_current (SHOW GLOBAL STATUS)
//     moved during the drain. The log is the whole server's, so other
//     sessions add to it: the table shows the least over the drains.
//
// The session counters (SHOW SESSION STATUS) are read on each connection
// by the wrapper itself, on the wire: when the driver sends the
// connection's first command (twice, to learn what a sample costs) and
// when it sends COM_QUIT; the difference, less the samples' own cost, is
// that session's work, whatever other sessions do on the server. A
// connection that ends without COM_QUIT (a broken one) is left out of
// the server's counts and counted in detail as unsampled. The wrapper
// reads the protocol as go-sql-driver 1.8 speaks it here: no TLS, no
// compression, one packet per write.

// mysqlStatus is what a session sample reads.
var mysqlStatus = []string{
	"Handler_commit", "Handler_rollback", "Handler_write", "Handler_update", "Handler_delete",
	"Handler_read_first", "Handler_read_key", "Handler_read_last", "Handler_read_next", "Handler_read_prev",
	"Handler_read_rnd", "Handler_read_rnd_next", "Handler_icp_attempts", "Handler_tmp_write", "Handler_tmp_update",
	"Com_commit", "Com_rollback", "Created_tmp_tables", "Select_scan", "Select_full_join", "Sort_rows",
}

var mysqlStatusQuery = "SHOW SESSION STATUS WHERE Variable_name IN ('" + strings.Join(mysqlStatus, "', '") + "')"

// mysqlWork counts what one drain's connections send and what the server
// did for them.
type mysqlWork struct {
	client    clientWork
	prepares  atomic.Int64
	unsampled atomic.Int64 // sessions closed without their last sample
	mu        sync.Mutex
	session   map[string]int64 // the sessions' status counters, summed
	kinds     map[string]int64 // statements by kind (statementKind)
	times     map[string]time.Duration
}

var mysqlNetSeq atomic.Int64

// countedDSN returns a DSN like conf whose connections count into a
// fresh mysqlWork, on a network of their own registered with the driver.
// conf must use TCP.
func countedDSN(conf *mysqldriver.Config) (string, *mysqlWork, error) {
	if conf.Net != "tcp" || conf.TLS != nil || conf.TLSConfig != "" {
		return "", nil, fmt.Errorf("counting work needs a plain TCP DSN, not %s with TLS %q", conf.Net, conf.TLSConfig)
	}
	w := &mysqlWork{session: map[string]int64{}, kinds: map[string]int64{}, times: map[string]time.Duration{}}
	name := fmt.Sprintf("outboxbench%d", mysqlNetSeq.Add(1))
	mysqldriver.RegisterDialContext(name, func(ctx context.Context, addr string) (net.Conn, error) {
		d := net.Dialer{KeepAlive: 15 * time.Second}
		c, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return &countedConn{Conn: c, w: w}, nil
	})
	counted := conf.Clone()
	counted.Net = name
	return counted.FormatDSN(), w, nil
}

// sample returns the drain's work so far as a workSample and its detail.
func (w *mysqlWork) sample() (workSample, map[string]int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.session
	ws := workSample{
		statements: w.client.statements.Load(), roundTrips: w.client.roundTrips.Load(), clientTx: w.client.transactions.Load(),
		serverTx: s["Handler_commit"] + s["Handler_rollback"],
		rows:     s["Handler_write"] + s["Handler_update"] + s["Handler_delete"],
	}
	detail := map[string]int64{"prepares": w.prepares.Load(), "unsampled sessions": w.unsampled.Load()}
	for k, v := range s {
		detail[k] = v
	}
	for k, v := range w.kinds {
		detail[kindPrefix+k] = v
	}
	for k, v := range w.times {
		detail[timePrefix+k] = int64(v)
	}
	return ws, detail
}

// kindPrefix and timePrefix mark the statement counts and their times
// (nanoseconds) among a drain's detail.
const (
	kindPrefix = "stmt: "
	timePrefix = "time: "
)

// The commands of the client/server protocol that the wrapper tells apart.
const (
	comQuit        = 0x01
	comQuery       = 0x03
	comStmtPrepare = 0x16
	comStmtExecute = 0x17
	comStmtClose   = 0x19
)

// countedConn is one connection of a counted DSN. The driver uses it from
// one goroutine at a time.
type countedConn struct {
	net.Conn
	w            *mysqlWork
	started      atomic.Bool
	finished     atomic.Bool // the last sample is taken, or can no longer be
	inTx         bool
	lastPrepared string
	base, cost   map[string]int64
	// waiting is the kind of statement whose answer the driver reads
	// since sentAt; lastRead is when a read last brought bytes.
	waiting          string
	sentAt, lastRead time.Time
}

// Read notes when the answer to a command last brought bytes.
func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.lastRead = time.Now()
	}
	return n, err
}

// answered adds the time from the last command to the last byte of its
// answer to the command's kind: the server's time and the wire's, and the
// driver's between the packets of a result.
func (c *countedConn) answered() {
	if c.waiting == "" {
		return
	}
	if c.lastRead.After(c.sentAt) {
		c.w.mu.Lock()
		c.w.times[c.waiting] += c.lastRead.Sub(c.sentAt)
		c.w.mu.Unlock()
	}
	c.waiting = ""
}

// wait notes a command of kind sent now.
func (c *countedConn) wait(kind string) {
	c.waiting, c.sentAt = kind, time.Now()
}

// SyscallConn lets the driver check the socket for a closed connection,
// as it does on a plain TCP connection.
func (c *countedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// Write counts a command (the first packet of a request, sequence 0)
// before it goes out; a COM_QUIT first takes the session's last sample.
func (c *countedConn) Write(p []byte) (int, error) {
	if len(p) > 4 && p[3] == 0 {
		size := int(p[0]) | int(p[1])<<8 | int(p[2])<<16
		if err := c.command(p[4:min(4+size, len(p))]); err != nil {
			return 0, err
		}
	}
	return c.Conn.Write(p)
}

func (c *countedConn) command(payload []byte) error {
	cmd := payload[0]
	c.answered()
	if cmd == comQuit {
		if c.started.Load() {
			c.finish()
		}
		return nil
	}
	if !c.started.Load() {
		c.started.Store(true)
		if err := c.start(); err != nil {
			return err
		}
	}
	switch cmd {
	case comStmtClose:
	case comQuery:
		c.statement(string(payload[1:]))
	case comStmtPrepare:
		c.w.prepares.Add(1)
		c.w.client.roundTrips.Add(1)
		c.lastPrepared = string(payload[1:])
		c.wait(statementKind(c.lastPrepared))
	case comStmtExecute:
		// database/sql prepares a statement with arguments right before
		// it runs it, on the same connection.
		c.statement(c.lastPrepared)
	default:
		c.w.client.roundTrips.Add(1)
		c.wait(fmt.Sprintf("command %#x", cmd))
	}
	return nil
}

// statement counts one statement and the transaction it ends, if any.
func (c *countedConn) statement(text string) {
	c.w.client.statements.Add(1)
	c.w.client.roundTrips.Add(1)
	kind := statementKind(text)
	c.wait(kind)
	c.w.mu.Lock()
	c.w.kinds[kind]++
	c.w.mu.Unlock()
	switch head := strings.ToUpper(kind); {
	case strings.HasPrefix(head, "START TRANSACTION"), strings.HasPrefix(head, "BEGIN"):
		c.inTx = true
	case strings.HasPrefix(head, "COMMIT"), strings.HasPrefix(head, "ROLLBACK"):
		c.inTx = false
		c.w.client.transactions.Add(1)
	case strings.HasPrefix(head, "SET TRANSACTION"):
	default:
		if !c.inTx {
			c.w.client.transactions.Add(1)
		}
	}
}

var spaces = regexp.MustCompile(`\s+`)

// statementKind names a statement by the start and the end of its text,
// without quotes around names and with runs of white space made one space.
func statementKind(text string) string {
	k := spaces.ReplaceAllString(strings.TrimSpace(strings.ReplaceAll(text, "`", "")), " ")
	if len(k) > 84 {
		k = k[:50] + " ... " + k[len(k)-30:]
	}
	return k
}

// start samples the session twice: the second sample is the base, and
// the difference what a sample costs.
func (c *countedConn) start() error {
	first, err := c.sessionStatus()
	if err != nil {
		return fmt.Errorf("work: session status: %w", err)
	}
	if c.base, err = c.sessionStatus(); err != nil {
		return fmt.Errorf("work: session status: %w", err)
	}
	c.cost = map[string]int64{}
	for k, v := range c.base {
		c.cost[k] = v - first[k]
	}
	return nil
}

// finish adds the session's work since its base to the drain's.
func (c *countedConn) finish() {
	if c.finished.Swap(true) {
		return
	}
	last, err := c.sessionStatus()
	if err != nil {
		c.w.unsampled.Add(1)
		return
	}
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	for k, v := range last {
		c.w.session[k] += v - c.base[k] - c.cost[k]
	}
}

// Close counts a session that ends without COM_QUIT as unsampled.
func (c *countedConn) Close() error {
	if c.started.Load() && !c.finished.Swap(true) {
		c.w.unsampled.Add(1)
	}
	return c.Conn.Close()
}

// sessionStatus runs mysqlStatusQuery on the connection, outside the
// driver, and reads its rows of name and integer value.
func (c *countedConn) sessionStatus() (map[string]int64, error) {
	q := append([]byte{0, 0, 0, 0, comQuery}, mysqlStatusQuery...)
	size := len(q) - 4
	q[0], q[1], q[2] = byte(size), byte(size>>8), byte(size>>16)
	if _, err := c.Conn.Write(q); err != nil {
		return nil, err
	}
	first, err := c.packet()
	if err != nil {
		return nil, err
	}
	if first[0] == 0xff || first[0] == 0x00 {
		return nil, fmt.Errorf("no result set: %q", first)
	}
	cols, _ := lenencInt(first)
	for range cols { // column definitions
		if _, err := c.packet(); err != nil {
			return nil, err
		}
	}
	if _, err := c.packet(); err != nil { // EOF after the columns
		return nil, err
	}
	out := map[string]int64{}
	for {
		row, err := c.packet()
		if err != nil {
			return nil, err
		}
		if row[0] == 0xfe && len(row) < 9 { // EOF after the rows
			return out, nil
		}
		if row[0] == 0xff {
			return nil, fmt.Errorf("error in the result: %q", row)
		}
		name, rest := lenencString(row)
		value, _ := lenencString(rest)
		if v, err := strconv.ParseInt(value, 10, 64); err == nil {
			out[name] = v
		}
	}
}

// packet reads one packet's payload from the connection.
func (c *countedConn) packet() ([]byte, error) {
	var h [4]byte
	if _, err := io.ReadFull(c.Conn, h[:]); err != nil {
		return nil, err
	}
	p := make([]byte, int(h[0])|int(h[1])<<8|int(h[2])<<16)
	if _, err := io.ReadFull(c.Conn, p); err != nil {
		return nil, err
	}
	if len(p) == 0 {
		return nil, errors.New("empty packet")
	}
	return p, nil
}

// lenencInt reads a length-encoded integer and returns what follows it.
func lenencInt(b []byte) (uint64, []byte) {
	switch {
	case len(b) == 0:
		return 0, nil
	case b[0] < 0xfb:
		return uint64(b[0]), b[1:]
	case b[0] == 0xfc && len(b) >= 3:
		return uint64(binary.LittleEndian.Uint16(b[1:])), b[3:]
	case b[0] == 0xfd && len(b) >= 4:
		return uint64(b[1]) | uint64(b[2])<<8 | uint64(b[3])<<16, b[4:]
	case b[0] == 0xfe && len(b) >= 9:
		return binary.LittleEndian.Uint64(b[1:]), b[9:]
	}
	return 0, nil // NULL (0xfb) or a short packet
}

// lenencString reads a length-encoded string and returns what follows it.
func lenencString(b []byte) (string, []byte) {
	n, rest := lenencInt(b)
	if uint64(len(rest)) < n {
		return "", nil
	}
	return string(rest[:n]), rest[n:]
}

// redoLSN reads how far the server's redo log has come.
func redoLSN(ctx context.Context, admin *sql.DB) (int64, error) {
	var name string
	var lsn int64
	if err := admin.QueryRowContext(ctx, `SHOW GLOBAL STATUS LIKE 'Innodb_lsn_current'`).Scan(&name, &lsn); err != nil {
		return 0, fmt.Errorf("redo log position: %w", err)
	}
	return lsn, nil
}

// measureMySQLWork runs drain, which opens its connections from the
// counted DSN it is given, and attaches what they asked of the server.
func measureMySQLWork(ctx context.Context, admin *sql.DB, conf *mysqldriver.Config, drain func(dsn string) (drainResult, error)) (drainResult, error) {
	dsn, w, err := countedDSN(conf)
	if err != nil {
		return drainResult{}, err
	}
	before, err := redoLSN(ctx, admin)
	if err != nil {
		return drainResult{}, err
	}
	res, err := drain(dsn)
	if err != nil {
		return res, err
	}
	after, err := redoLSN(ctx, admin)
	if err != nil {
		return drainResult{}, err
	}
	s, detail := w.sample()
	s.walBytes = after - before
	res.work = &serverWork{workSample: s, events: res.done, batches: res.batches, detail: detail}
	return res, nil
}

// mysqlDetailRow formats what the MySQL drains of a figure counted
// beyond the work table: medians over the drains, per event or batch.
func mysqlDetailRow(system, config string, rs []drainResult) []string {
	ws := measured(rs)
	row := []string{system, config}
	for _, c := range mysqlDetailColumns {
		if len(ws) == 0 {
			row = append(row, "-")
			continue
		}
		sum := func(w *serverWork) int64 {
			var n int64
			for _, k := range c.counters {
				n += w.detail[k]
			}
			return n
		}
		per := perEvent(sum)
		if c.perBatch {
			per = perBatch(sum)
		}
		row = append(row, workStat(ws, per, f2, false))
	}
	return row
}

// mysqlDetailColumns are the columns of the detail table.
var mysqlDetailColumns = []struct {
	name     string
	perBatch bool
	counters []string
}{
	{"prepares/batch", true, []string{"prepares"}},
	{"rows read/event", false, []string{"Handler_read_first", "Handler_read_key", "Handler_read_last", "Handler_read_next", "Handler_read_prev", "Handler_read_rnd", "Handler_read_rnd_next"}},
	{"of them by scan (rnd_next)/event", false, []string{"Handler_read_rnd_next"}},
	{"index entries tried by ICP/event", false, []string{"Handler_icp_attempts"}},
	{"temp rows written/event", false, []string{"Handler_tmp_write", "Handler_tmp_update"}},
	{"temp tables/batch", true, []string{"Created_tmp_tables"}},
	{"full scans/batch", true, []string{"Select_scan"}},
	{"joins without index/batch", true, []string{"Select_full_join"}},
	{"rows sorted/event", false, []string{"Sort_rows"}},
	{"COMMITs/batch", true, []string{"Com_commit"}},
	{"unsampled sessions", true, []string{"unsampled sessions"}},
}

func mysqlDetailHeader() []string {
	h := []string{"system", "configuration"}
	for _, c := range mysqlDetailColumns {
		h = append(h, c.name)
	}
	return h
}

// statementRows lists the statements of a figure's drains by kind, with
// how many of each a batch sent and how long they took a batch, from the
// command to the last byte of its answer, prepares included (over all
// the drains: the time moves with the machine's load), most first.
func statementRows(system, config string, rs []drainResult) [][]string {
	counts := map[string]int64{}
	times := map[string]int64{}
	batches := 0
	for _, w := range measured(rs) {
		batches += w.batches
		for k, v := range w.detail {
			if kind, ok := strings.CutPrefix(k, kindPrefix); ok {
				counts[kind] += v
			} else if kind, ok := strings.CutPrefix(k, timePrefix); ok {
				times[kind] += v
			}
		}
	}
	if batches == 0 {
		return nil
	}
	kinds := make([]string, 0, len(counts))
	for k := range counts {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool {
		if counts[kinds[i]] != counts[kinds[j]] {
			return counts[kinds[i]] > counts[kinds[j]]
		}
		return kinds[i] < kinds[j]
	})
	var rows [][]string
	for _, k := range kinds {
		rows = append(rows, []string{system, config, f2(float64(counts[k]) / float64(batches)),
			fmt.Sprintf("%.3f", float64(times[k])/1e6/float64(batches)), k})
	}
	return rows
}
