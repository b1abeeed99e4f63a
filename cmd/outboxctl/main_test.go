package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	mysqldriver "github.com/go-sql-driver/mysql"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

// ctl runs one outboxctl command line in-process and returns what it
// printed and its exit status.
func ctl(t *testing.T, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), args, &out, &errOut)
	return out.String(), errOut.String(), code
}

// mustCtl runs a command line that must succeed.
func mustCtl(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := ctl(t, args...)
	if code != 0 {
		t.Fatalf("outboxctl %s: exit %d, stderr %q", strings.Join(args, " "), code, errOut)
	}
	return out
}

// fixture is a migrated database on one engine and its --db URL.
type fixture struct {
	db  *gorm.DB
	url string
	e   outboxtest.Engine
}

// dbURL turns the test database's DSN into the URL outboxctl takes.
func dbURL(info outboxtest.DB) string {
	if info.Engine == outboxtest.SQLite {
		return "sqlite:" + info.DSN
	}
	if info.Engine == outboxtest.MySQL {
		return "mysql://" + info.DSN
	}
	if strings.HasPrefix(info.DSN, "postgres://") || strings.HasPrefix(info.DSN, "postgresql://") {
		base, schema, _ := strings.Cut(info.DSN, " search_path=")
		sep := "?"
		if strings.Contains(base, "?") {
			sep = "&"
		}
		return base + sep + "search_path=" + schema
	}
	kv := map[string]string{}
	for _, f := range strings.Fields(info.DSN) {
		k, v, _ := strings.Cut(f, "=")
		kv[k] = v
	}
	user := kv["user"]
	if kv["password"] != "" {
		user += ":" + kv["password"]
	}
	return fmt.Sprintf("postgres://%s@%s:%s/%s?sslmode=%s&search_path=%s",
		user, kv["host"], kv["port"], kv["dbname"], kv["sslmode"], kv["search_path"])
}

func newFixture(t *testing.T, e outboxtest.Engine) fixture {
	t.Helper()
	db, info := outboxtest.Open(t, e, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return fixture{db: db, url: dbURL(info), e: e}
}

// ts returns t as timestamps are stored on the fixture's engine, for
// statements that plant rows.
func (f fixture) ts(t time.Time) any {
	if f.e == outboxtest.SQLite {
		return t.UTC().Format("2006-01-02 15:04:05.000000000+00:00")
	}
	return t
}

func (f fixture) publish(t *testing.T, events ...outbox.Event) {
	t.Helper()
	for _, ev := range events {
		if err := outbox.Publish(f.db, ev); err != nil {
			t.Fatal(err)
		}
	}
}

func (f fixture) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if err := f.db.Exec(sql, args...).Error; err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func (f fixture) state(t *testing.T, eventID string) string {
	t.Helper()
	var s string
	if err := f.db.Raw(`SELECT delivery_state FROM outbox_records WHERE event_id = ?`, eventID).Scan(&s).Error; err != nil {
		t.Fatal(err)
	}
	return s
}

// filled writes: order/1 with o1 (delivered two hours ago) and o2
// (failed, a minute ago), order/2 with p1 (pending), and user/9 with u1
// (failed an hour ago).
func filled(t *testing.T, e outboxtest.Engine) fixture {
	t.Helper()
	f := newFixture(t, e)
	f.publish(t,
		outbox.Event{ID: "o1", Type: "order.created", AggregateType: "order", AggregateID: "1", Payload: map[string]int{"total": 3}},
		outbox.Event{ID: "o2", Type: "order.paid", AggregateType: "order", AggregateID: "1", Payload: map[string]int{"total": 3},
			Headers: map[string]string{"trace": "t-1"}},
		outbox.Event{ID: "p1", Type: "order.created", AggregateType: "order", AggregateID: "2"},
		outbox.Event{ID: "u1", Type: "user.created", AggregateType: "user", AggregateID: "9"},
	)
	now := time.Now()
	f.exec(t, `UPDATE outbox_records SET delivery_state = 'delivered', delivery_attempts = 1, delivered_at = ?, created_at = ? WHERE event_id = 'o1'`,
		f.ts(now.Add(-2*time.Hour)), f.ts(now.Add(-3*time.Hour)))
	f.exec(t, `UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10, last_error = 'broker said no', updated_at = ? WHERE event_id = 'o2'`,
		f.ts(now.Add(-time.Minute)))
	f.exec(t, `UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 1, last_error = 'permanent: bad schema', updated_at = ? WHERE event_id = 'u1'`,
		f.ts(now.Add(-time.Hour)))
	return f
}

// eachEngine runs fn as a parallel subtest against a filled database on
// each engine.
func eachEngine(t *testing.T, fn func(t *testing.T, f fixture)) {
	t.Helper()
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			fn(t, filled(t, e))
		})
	}
}

func eventIDs(t *testing.T, out string) []string {
	t.Helper()
	var msgs []outboxinspect.MessageInfo
	if err := json.Unmarshal([]byte(out), &msgs); err != nil {
		t.Fatalf("not a JSON list of messages: %v\n%s", err, out)
	}
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.EventID
	}
	return ids
}

func TestStatsCountsByStateAndNamesTheLastFailure(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		var s struct {
			Pending             int64    `json:"pending"`
			Delivered           int64    `json:"delivered"`
			Failed              int64    `json:"failed"`
			OldestDueAgeSeconds *float64 `json:"oldest_due_age_seconds"`
			LastFailure         string   `json:"last_failure"`
		}
		out := mustCtl(t, "stats", "--db", f.url, "-o", "json")
		if err := json.Unmarshal([]byte(out), &s); err != nil {
			t.Fatal(err)
		}
		var names map[string]any
		if err := json.Unmarshal([]byte(out), &names); err != nil {
			t.Fatal(err)
		}
		for name := range names {
			if name != strings.ToLower(name) {
				t.Fatalf("stats -o json names %q; want every name in snake_case:\n%s", name, out)
			}
		}
		if s.Pending != 1 || s.Delivered != 1 || s.Failed != 2 || s.LastFailure != "broker said no" || s.OldestDueAgeSeconds == nil {
			t.Fatalf("stats %+v", s)
		}
		out = mustCtl(t, "stats", "--db", f.url)
		for _, want := range []string{"failed      2", "pending     1", "last failure  broker said no"} {
			if !strings.Contains(out, want) {
				t.Fatalf("stats table lacks %q:\n%s", want, out)
			}
		}
	})
}

func TestListFiltersByStateTypeAggregateAndAge(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		for _, tc := range []struct {
			args []string
			want string
		}{
			{nil, "u1 p1 o2 o1"},
			{[]string{"--oldest", "--limit", "2"}, "o1 o2"},
			{[]string{"--state", "failed"}, "u1 o2"},
			{[]string{"--state", "pending,delivered", "--oldest"}, "o1 p1"},
			{[]string{"--type", "order.created", "--oldest"}, "o1 p1"},
			{[]string{"--aggregate-type", "order", "--aggregate-id", "1", "--sequence-order"}, "o1 o2"},
			{[]string{"--older-than", "1h"}, "o1"},
			{[]string{"--newer-than", "1h", "--oldest"}, "o2 p1 u1"},
		} {
			args := append([]string{"list", "--db", f.url, "-o", "json"}, tc.args...)
			if got := strings.Join(eventIDs(t, mustCtl(t, args...)), " "); got != tc.want {
				t.Errorf("list %v: got %q, want %q", tc.args, got, tc.want)
			}
		}
		out := mustCtl(t, "list", "--db", f.url, "--state", "failed")
		if !strings.Contains(out, "EVENT_ID") || !strings.Contains(out, "broker said no") || !strings.Contains(out, "2 message(s)") {
			t.Fatalf("list table:\n%s", out)
		}
	})
}

func TestShowPrintsTheWholeMessage(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		out := mustCtl(t, "show", "--db", f.url, "o2")
		for _, want := range []string{"order.paid", "order/1", "failed", "attempts         10", "broker said no", "trace: t-1", "payload:\n{\n  \"total\": 3\n}"} {
			if !strings.Contains(out, want) {
				t.Fatalf("show lacks %q:\n%s", want, out)
			}
		}
		var m outboxinspect.MessageInfo
		if err := json.Unmarshal([]byte(mustCtl(t, "show", "--db", f.url, "o2", "-o", "json")), &m); err != nil || m.Attempts != 10 || m.Headers["trace"] != "t-1" {
			t.Fatalf("show -o json: %+v, %v", m, err)
		}
	})
}

func TestRequeueDryRunShowsWhatWouldMoveAndMovesNothing(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		if got := strings.Join(eventIDs(t, mustCtl(t, "requeue", "--db", f.url, "--all", "--dry-run", "-o", "json")), " "); got != "u1 o2" {
			t.Fatalf("dry run would move %q, want the failed ones, oldest failure first", got)
		}
		if got := strings.Join(eventIDs(t, mustCtl(t, "requeue", "--db", f.url, "--failed-before", "30m", "--dry-run", "-o", "json")), " "); got != "u1" {
			t.Fatalf("dry run of --failed-before 30m would move %q", got)
		}
		if f.state(t, "u1") != outbox.StateFailed || f.state(t, "o2") != outbox.StateFailed {
			t.Fatal("a dry run moved messages")
		}
	})
}

func TestRequeueMovesFailedMessagesByIDTypeAndTime(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		if out := mustCtl(t, "requeue", "--db", f.url, "--type", "user.created"); out != "requeued 1 message(s)\n" {
			t.Fatalf("requeue --type printed %q", out)
		}
		if f.state(t, "u1") != outbox.StatePending || f.state(t, "o2") != outbox.StateFailed {
			t.Fatal("requeue --type moved the wrong messages")
		}
		mustCtl(t, "requeue", "--db", f.url, "--failed-before", time.Now().Add(-30*time.Second).UTC().Format(time.RFC3339))
		if f.state(t, "o2") != outbox.StatePending {
			t.Fatal("requeue --failed-before did not move o2")
		}
		f.exec(t, `UPDATE outbox_records SET delivery_state = 'failed' WHERE event_id = 'o2'`)
		if out := mustCtl(t, "requeue", "--db", f.url, "--id", "o2", "-o", "json"); strings.TrimSpace(out) != `{"requeued":1}` {
			t.Fatalf("requeue --id printed %q", out)
		}
		if _, errOut, code := ctl(t, "requeue", "--db", f.url); code != 1 || !strings.Contains(errOut, "--all") {
			t.Fatalf("requeue without a selection: exit %d, %q", code, errOut)
		}
	})
}

// discarded returns the event ids of the discarded table, in id order.
func (f fixture) discarded(t *testing.T) string {
	t.Helper()
	var ids []string
	if err := f.db.Raw(`SELECT event_id FROM outbox_records_discarded ORDER BY id`).Scan(&ids).Error; err != nil {
		t.Fatal(err)
	}
	return strings.Join(ids, " ")
}

func TestDiscardDryRunShowsWhatWouldGoAndChangesNothing(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		if got := strings.Join(eventIDs(t, mustCtl(t, "discard", "--db", f.url, "--all", "--dry-run", "-o", "json")), " "); got != "u1 o2" {
			t.Fatalf("dry run would discard %q, want the failed ones, oldest failure first", got)
		}
		if got := strings.Join(eventIDs(t, mustCtl(t, "discard", "--db", f.url, "--failed-before", "30m", "--dry-run", "-o", "json")), " "); got != "u1" {
			t.Fatalf("dry run of --failed-before 30m would discard %q", got)
		}
		if f.state(t, "u1") != outbox.StateFailed || f.state(t, "o2") != outbox.StateFailed || f.discarded(t) != "" {
			t.Fatal("a dry run discarded messages")
		}
	})
}

func TestDiscardTakesFailedMessagesOutOfDeliveryForGood(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		if _, errOut, code := ctl(t, "discard", "--db", f.url); code != 1 || !strings.Contains(errOut, "--all") {
			t.Fatalf("discard without a selection: exit %d, %q", code, errOut)
		}
		if out, errOut, code := ctl(t, "discard", "--db", f.url, "--type", "user.created"); code != 0 || out != "discarded 1 message(s)\n" || !strings.Contains(errOut, "event_id=u1") {
			t.Fatalf("discard --type: exit %d, printed %q, logged %q; want the count, and u1 logged", code, out, errOut)
		}
		if f.state(t, "u1") != "" || f.state(t, "o2") != outbox.StateFailed || f.discarded(t) != "u1" {
			t.Fatalf("discard --type took the wrong messages: u1 %q, o2 %q, discarded %q", f.state(t, "u1"), f.state(t, "o2"), f.discarded(t))
		}
		// Only failed messages: p1 is pending and stays.
		if out := mustCtl(t, "discard", "--db", f.url, "--id", "o2,p1", "-o", "json"); strings.TrimSpace(out) != `{"discarded":1}` {
			t.Fatalf("discard --id printed %q", out)
		}
		if f.state(t, "p1") != outbox.StatePending || f.discarded(t) != "o2 u1" {
			t.Fatalf("after discard --id: p1 %q, discarded %q", f.state(t, "p1"), f.discarded(t))
		}
		if out := mustCtl(t, "requeue", "--db", f.url, "--all"); out != "requeued 0 message(s)\n" {
			t.Fatalf("requeue after discard printed %q", out)
		}
	})
}

func TestPurgeDryRunCountsAndDeletesNothing(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		if out := mustCtl(t, "purge", "--db", f.url, "--older-than", "1h", "--dry-run"); out != "would purge 1 message(s)\n" {
			t.Fatalf("purge --dry-run printed %q", out)
		}
		if out := mustCtl(t, "purge", "--db", f.url, "--older-than", "1h", "--dry-run", "-o", "json"); strings.TrimSpace(out) != `{"would_purge":1}` {
			t.Fatalf("purge --dry-run -o json printed %q", out)
		}
		if f.state(t, "o1") != outbox.StateDelivered {
			t.Fatal("a dry run purged o1")
		}
	})
}

func TestAgesTakeDays(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		f.exec(t, `UPDATE outbox_records SET created_at = ?, delivered_at = ? WHERE event_id = 'o1'`,
			f.ts(time.Now().Add(-50*time.Hour)), f.ts(time.Now().Add(-49*time.Hour)))
		if got := strings.Join(eventIDs(t, mustCtl(t, "list", "--db", f.url, "--older-than", "2d", "-o", "json")), " "); got != "o1" {
			t.Fatalf("list --older-than 2d: %q", got)
		}
		if got := strings.Join(eventIDs(t, mustCtl(t, "list", "--db", f.url, "--older-than", "2d3h", "-o", "json")), " "); got != "" {
			t.Fatalf("list --older-than 2d3h: %q", got)
		}
		if out := mustCtl(t, "purge", "--db", f.url, "--older-than", "2d", "--dry-run"); out != "would purge 1 message(s)\n" {
			t.Fatalf("purge --older-than 2d --dry-run printed %q", out)
		}
		if out := mustCtl(t, "purge", "--db", f.url, "--older-than", "3d"); out != "purged 0 message(s)\n" {
			t.Fatalf("purge --older-than 3d printed %q", out)
		}
		if got := strings.Join(eventIDs(t, mustCtl(t, "requeue", "--db", f.url, "--failed-before", "1d", "--dry-run", "-o", "json")), " "); got != "" {
			t.Fatalf("requeue --failed-before 1d would move %q", got)
		}
	})
}

func TestParseAge(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		ok   bool
	}{
		{"90m", 90 * time.Minute, true},
		{"36h", 36 * time.Hour, true},
		{"1d", 24 * time.Hour, true},
		{"7d", 7 * 24 * time.Hour, true},
		{"1d12h", 36 * time.Hour, true},
		{"0d", 0, false},
		{"-1h", 0, false},
		{"d", 0, false},
		{"1w", 0, false},
		{"1d 2h", 0, false},
	} {
		got, err := parseAge(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseAge(%q) = %v, %v; want %v (ok %v)", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestDatabaseURLForms(t *testing.T) {
	t.Run("PostgreSQL key=value DSN", func(t *testing.T) {
		t.Parallel()
		_, info := outboxtest.Open(t, outboxtest.Postgres, nil)
		dsn := info.DSN
		if strings.Contains(dsn, "://") {
			t.Skip("OUTBOX_POSTGRES_DSN is a URL; the key=value form is tested with the default DSN")
		}
		mustCtl(t, "migrate", "--db", dsn)
		// Quoted values with spaces and escapes, as libpq takes them (the
		// test server trusts every password).
		quoted := dsn + ` application_name = 'outboxctl\'s test' password='a b'`
		for _, dsn := range []string{dsn, quoted} {
			if out := mustCtl(t, "stats", "--db", dsn); !strings.Contains(out, "pending     0") {
				t.Fatalf("stats through %q:\n%s", dsn, out)
			}
		}
	})
	t.Run("MySQL URL", func(t *testing.T) {
		t.Parallel()
		_, info := outboxtest.Open(t, outboxtest.MySQL, nil)
		conf, err := mysqldriver.ParseDSN(info.DSN)
		if err != nil {
			t.Fatal(err)
		}
		u := url.URL{Scheme: "mysql", Host: conf.Addr, Path: "/" + conf.DBName}
		if conf.Passwd != "" {
			u.User = url.UserPassword(conf.User, conf.Passwd)
		} else {
			u.User = url.User(conf.User)
		}
		mustCtl(t, "migrate", "--db", u.String())
		if out := mustCtl(t, "stats", "--db", u.String()); !strings.Contains(out, "pending     0") {
			t.Fatalf("stats through %s:\n%s", u.String(), out)
		}
	})
	for _, tc := range []struct{ rest, want string }{
		{"root@tcp(127.0.0.1:3306)/app?parseTime=true", "root@tcp(127.0.0.1:3306)/app?parseTime=true"},
		{"user:pass@db.example:3307/app", "user:pass@tcp(db.example:3307)/app"},
		{"user:p%40ss@db.example/app?tls=true", "user:p@ss@tcp(db.example:3306)/app?tls=true"},
		{"db.example/app", "tcp(db.example:3306)/app"},
	} {
		if got, err := mysqlDSN(tc.rest); err != nil || got != tc.want {
			t.Errorf("mysqlDSN(%q) = %q, %v; want %q", tc.rest, got, err, tc.want)
		}
	}
	for s, want := range map[string]bool{
		"host=localhost user=gorm password=gorm dbname=gorm port=9920 sslmode=disable": true,
		"dbname=app":                        true,
		"host=db password='a b' dbname=app": true,
		"sqlite:./a=b.db":                   false,
		"color=blue":                        false,
		"postgres://x/y?host=z":             false,
		"host=db password='a b":             false,
	} {
		if got := keyValueDSN(s); got != want {
			t.Errorf("keyValueDSN(%q) = %v, want %v", s, got, want)
		}
	}
}

func TestParseConninfoReadsLibpqConnectionStrings(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in   string
		want map[string]string
	}{
		{"host=localhost dbname=app", map[string]string{"host": "localhost", "dbname": "app"}},
		{"  host = localhost\tdbname= app port =5432 ", map[string]string{"host": "localhost", "dbname": "app", "port": "5432"}},
		{"password='a b' host=db", map[string]string{"password": "a b", "host": "db"}},
		{`password='it\'s a \\ b' host=db`, map[string]string{"password": `it's a \ b`, "host": "db"}},
		{`password=a\ b\'c host=db`, map[string]string{"password": "a b'c", "host": "db"}},
		{"password='' host=db", map[string]string{"password": "", "host": "db"}},
		{"password= host=db", map[string]string{"password": "host=db"}}, // as libpq: the value follows the spaces
		{"options='-c search_path=s1'dbname=app", map[string]string{"options": "-c search_path=s1", "dbname": "app"}},
		{"password='a=b c'", map[string]string{"password": "a=b c"}},
		{"dbname=app password=x\\", map[string]string{"dbname": "app", "password": "x"}}, // as libpq: a final backslash stands for nothing
		{"", map[string]string{}},
	} {
		got, err := parseConninfo(tc.in)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseConninfo(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{"host=db password='a b", `the value of "password" has no closing quote`},
		{`host=db password='a b\'`, `the value of "password" has no closing quote`},
		{"host=db dbname", `no = after "dbname"`},
		{"host db", `no = after "host"`},
		{"=db", `"" is not a connection parameter name`},
		{"postgres://x/y?host=z", `"postgres://x/y?host" is not a connection parameter name`},
		{"sqlite:./a=b.db", `"sqlite:./a" is not a connection parameter name`},
	} {
		if got, err := parseConninfo(tc.in); err == nil || err.Error() != tc.want {
			t.Errorf("parseConninfo(%q) = %q, %v; want the error %s", tc.in, got, err, tc.want)
		}
	}
}

func TestPurgeDeletesOnlyDeliveredMessagesOlderThanTheAge(t *testing.T) {
	eachEngine(t, func(t *testing.T, f fixture) {
		f.publish(t, outbox.Event{ID: "o3", Type: "order.paid", AggregateType: "order", AggregateID: "1"})
		f.exec(t, `UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE event_id = 'o3'`, f.ts(time.Now()))
		if out := mustCtl(t, "purge", "--db", f.url, "--older-than", "1h", "--batch", "1"); out != "purged 1 message(s)\n" {
			t.Fatalf("purge printed %q", out)
		}
		if got := strings.Join(eventIDs(t, mustCtl(t, "list", "--db", f.url, "--oldest", "-o", "json")), " "); got != "o2 p1 u1 o3" {
			t.Fatalf("after purge: %q", got)
		}
		if _, errOut, code := ctl(t, "purge", "--db", f.url); code != 1 || !strings.Contains(errOut, "--older-than") {
			t.Fatalf("purge without an age: exit %d, %q", code, errOut)
		}
	})
}

func TestMigrateCreatesTheTablesOfANewDatabase(t *testing.T) {
	t.Parallel()
	url := "sqlite:" + filepath.Join(t.TempDir(), "new.db")
	if _, errOut, code := ctl(t, "stats", "--db", url); code != 1 || !strings.Contains(errOut, "does not exist") {
		t.Fatalf("stats before migrate: exit %d, %q", code, errOut)
	}
	if out := mustCtl(t, "migrate", "--db", url, "--table", "events"); out != "migrated events\n" {
		t.Fatalf("migrate printed %q", out)
	}
	mustCtl(t, "migrate", "--db", url, "--table", "events") // again: a no-op
	if out := mustCtl(t, "stats", "--db", url, "--table", "events"); !strings.Contains(out, "pending     0") {
		t.Fatalf("stats after migrate:\n%s", out)
	}
	if _, errOut, code := ctl(t, "stats", "--db", url); code != 1 || !strings.Contains(errOut, "table outbox_records does not exist") {
		t.Fatalf("stats of another table: exit %d, %q", code, errOut)
	}
}

func TestMigrateOnPostgres(t *testing.T) {
	t.Parallel()
	db, info := outboxtest.Open(t, outboxtest.Postgres, nil)
	url := dbURL(info)
	if out := mustCtl(t, "migrate", "--db", url); out != "migrated outbox_records\n" {
		t.Fatalf("migrate printed %q", out)
	}
	if !db.Migrator().HasTable("outbox_records_sequences") {
		t.Fatal("migrate did not create the sequence table")
	}
}

func TestCheckPassesAHealthyTable(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			f := newFixture(t, e)
			f.publish(t, outbox.Event{ID: "a", Type: "t", AggregateType: "agg", AggregateID: "1"})
			if out := mustCtl(t, "check", "--db", f.url); out != "ok: no violation\n" {
				t.Fatalf("check printed %q", out)
			}
		})
	}
}

// Each case plants one broken promise by SQL on pending events a1, a2, a3
// of aggregate agg/1; check must print it and exit with status 2.
func TestCheckReportsEachPlantedViolationAndExitsTwo(t *testing.T) {
	for _, tc := range []struct {
		kind  string
		plant func(t *testing.T, f fixture)
	}{
		{outboxinspect.ViolationSequenceGap, func(t *testing.T, f fixture) {
			f.exec(t, `DELETE FROM outbox_records WHERE event_id = 'a2'`)
		}},
		{outboxinspect.ViolationOrder, func(t *testing.T, f fixture) {
			f.exec(t, `UPDATE outbox_records SET delivery_state = 'delivered', delivered_at = ? WHERE event_id = 'a2'`, f.ts(time.Now()))
		}},
		{outboxinspect.ViolationExpiredLease, func(t *testing.T, f fixture) {
			f.exec(t, `UPDATE outbox_records SET delivery_state = 'delivering', locked_until = ? WHERE event_id = 'a1'`, f.ts(time.Now().Add(-time.Hour)))
		}},
		{outboxinspect.ViolationDuplicateKey, func(t *testing.T, f fixture) {
			if f.e == outboxtest.Postgres {
				f.exec(t, `ALTER TABLE outbox_records DROP CONSTRAINT outbox_records_idempotency_key_key`)
			} else {
				f.exec(t, `CREATE TABLE outbox_copy AS SELECT * FROM outbox_records`)
				f.exec(t, `DROP TABLE outbox_records`)
				f.exec(t, `ALTER TABLE outbox_copy RENAME TO outbox_records`)
			}
			f.exec(t, `UPDATE outbox_records SET idempotency_key = 'same' WHERE event_id IN ('a1', 'a3')`)
		}},
		{outboxinspect.ViolationDueAge, func(t *testing.T, f fixture) {
			f.exec(t, `UPDATE outbox_records SET next_attempt_at = ? WHERE event_id = 'a1'`, f.ts(time.Now().Add(-time.Hour)))
		}},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			t.Parallel()
			for _, e := range outboxtest.Engines {
				t.Run(string(e), func(t *testing.T) {
					t.Parallel()
					f := newFixture(t, e)
					for _, id := range []string{"a1", "a2", "a3"} {
						f.publish(t, outbox.Event{ID: id, Type: "t", AggregateType: "agg", AggregateID: "1"})
					}
					tc.plant(t, f)
					out, errOut, code := ctl(t, "check", "--db", f.url)
					if code != 2 || !strings.HasPrefix(out, tc.kind) || strings.Count(out, "\n") != 1 {
						t.Fatalf("check: exit %d, stdout %q, stderr %q; want one %s line and exit 2", code, out, errOut, tc.kind)
					}
					if errOut != "outboxctl: check found violations: 1\n" {
						t.Fatalf("check stderr %q", errOut)
					}
					var vs []outboxinspect.Violation
					out, _, _ = ctl(t, "check", "--db", f.url, "-o", "json")
					if err := json.Unmarshal([]byte(out), &vs); err != nil || len(vs) != 1 || vs[0].Kind != tc.kind {
						t.Fatalf("check -o json: %v, %s", err, out)
					}
				})
			}
		})
	}
}

func TestCheckThresholdsAreFlags(t *testing.T) {
	t.Parallel()
	f := newFixture(t, outboxtest.SQLite)
	f.publish(t, outbox.Event{ID: "a1", Type: "t", AggregateType: "agg", AggregateID: "1"})
	f.exec(t, `UPDATE outbox_records SET next_attempt_at = ? WHERE event_id = 'a1'`, f.ts(time.Now().Add(-time.Hour)))
	mustCtl(t, "check", "--db", f.url, "--max-due-age", "2h")
	mustCtl(t, "check", "--db", f.url, "--no-lag")
	if _, _, code := ctl(t, "check", "--db", f.url, "--max-due-age", "30m"); code != 2 {
		t.Fatalf("check --max-due-age 30m: exit %d, want 2", code)
	}
}

// Errors are one line on stderr, starting with the program's name, and
// exit status 1.
func TestErrorsAreOneClearLine(t *testing.T) {
	t.Parallel()
	f := filled(t, outboxtest.SQLite)
	missing := "sqlite:" + filepath.Join(t.TempDir(), "missing.db")
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unreachable database", []string{"stats", "--db", "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2"}, "cannot reach the database"},
		{"missing SQLite file", []string{"stats", "--db", missing}, "does not exist"},
		{"missing table", []string{"list", "--db", f.url, "--table", "nope"}, "table nope does not exist"},
		{"unknown event id", []string{"show", "--db", f.url, "no-such-event"}, `no event "no-such-event"`},
		{"no database", []string{"stats", "--db", ""}, "--db is required"},
		{"unknown scheme", []string{"stats", "--db", "oracle://x"}, "is not a database URL"},
		{"unknown scheme with a password", []string{"stats", "--db", "oracle://scott:tiger@db/x"}, `"oracle://..." is not a database URL`},
		{"empty MySQL DSN", []string{"stats", "--db", "mysql://"}, "needs a DSN"},
		{"unterminated quote in a key=value DSN", []string{"stats", "--db", "host=127.0.0.1 dbname=test password='a b"}, `the value of "password" has no closing quote`},
		{"bad output", []string{"stats", "--db", f.url, "-o", "yaml"}, "--output"},
		{"bad state", []string{"list", "--db", f.url, "--state", "lost"}, `--state "lost"`},
		{"bad time", []string{"requeue", "--db", f.url, "--failed-before", "yesterday"}, "--failed-before"},
		{"short token", []string{"serve", "--db", f.url, "--token", "short"}, "at least 16 bytes"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, errOut, code := ctl(t, tc.args...)
			if code != 1 || out != "" || !strings.HasPrefix(errOut, "outboxctl: ") || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, tc.want) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want one line with %q and exit 1", code, out, errOut, tc.want)
			}
			if strings.Contains(errOut, "tiger") {
				t.Errorf("stderr %q shows the password", errOut)
			}
		})
	}
}

func TestServeServesTheDashboardBehindItsToken(t *testing.T) {
	t.Parallel()
	f := filled(t, outboxtest.SQLite)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	var out bytes.Buffer
	go func() {
		done <- run(ctx, []string{"serve", "--db", f.url, "--addr", addr, "--token", "0123456789abcdef"}, &out, &out)
	}()
	get := func(token string) int {
		req, _ := http.NewRequest("GET", "http://"+addr+"/dead", nil)
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0
		}
		res.Body.Close()
		return res.StatusCode
	}
	outboxtest.WaitUntil(t, func() bool { return get("0123456789abcdef") == http.StatusOK }, "the dashboard to answer")
	if code := get(""); code != http.StatusUnauthorized {
		t.Fatalf("without the token: %d", code)
	}
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("serve exited %d: %s", code, out.String())
	}
}
