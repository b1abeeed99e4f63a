package outbox_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
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
