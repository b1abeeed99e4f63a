package outbox_test

import (
	"errors"

	"github.com/go-sql-driver/mysql"
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
