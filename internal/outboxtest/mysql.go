package outboxtest

import (
	"os"
	"testing"

	mysqldriver "github.com/go-sql-driver/mysql"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"
)

// MySQL is the MySQL engine: MySQL 8.0+ by design, MariaDB 10.6+ in the
// tests (the machine runs MariaDB 10.11).
const MySQL Engine = "MySQL"

// DefaultMySQLDSN is used when OUTBOX_MYSQL_DSN is not set. parseTime
// makes DATETIME columns read as time.Time, in loc.
const DefaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test?parseTime=true&loc=UTC"

// MySQLDSN returns the server to test against.
func MySQLDSN() string {
	if dsn := os.Getenv("OUTBOX_MYSQL_DSN"); dsn != "" {
		return dsn
	}
	return DefaultMySQLDSN
}

// OpenMySQL returns a fresh, empty database of its own on the server named
// by OUTBOX_MYSQL_DSN (CREATE DATABASE outbox_test_<pid>_<n>, utf8mb4),
// opened with cfg (nil for the defaults), and drops it when t ends; t
// holds the server meanwhile (UseServer). When the server does not
// answer, t skips with a message naming the variable, or fails under
// CI=true.
func OpenMySQL(t testing.TB, cfg *gorm.Config) (*gorm.DB, DB) {
	t.Helper()
	UseServer(t, MySQL)
	base := MySQLDSN()
	conf, err := mysqldriver.ParseDSN(base)
	if err != nil {
		t.Fatalf("outboxtest: OUTBOX_MYSQL_DSN %q: %v", base, err)
	}
	admin := openAdmin(t, "mysql", base, "MySQL", "OUTBOX_MYSQL_DSN")
	name := uniqueName()
	if _, err := admin.Exec("CREATE DATABASE `" + name + "` CHARACTER SET utf8mb4"); err != nil {
		admin.Close()
		t.Fatalf("outboxtest: create database: %v", err)
	}
	conf.DBName = name
	dsn := conf.FormatDSN()
	db, err := gorm.Open(mysql.Open(dsn), config(cfg))
	if err != nil {
		admin.Exec("DROP DATABASE `" + name + "`")
		admin.Close()
		t.Fatalf("outboxtest: open MySQL: %v", err)
	}
	t.Cleanup(func() {
		closeDB(db)
		if _, err := admin.Exec("DROP DATABASE IF EXISTS `" + name + "`"); err != nil {
			t.Errorf("outboxtest: drop database %s: %v", name, err)
		}
		admin.Close()
	})
	return db, DB{Engine: MySQL, DSN: dsn, Config: cfg}
}
