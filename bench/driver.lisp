;;;; The benchmark driver: every server of *SERVERS* against every workload
;;;; of *WORKLOADS*, each cell in a fresh server process, measured by wrk.
;;;; Writes bench/results/<UTC timestamp>/ and prints a ratio table.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *servers*
  '((:name "hunchentoot" :label "Hunchentoot easy-acceptor" :lisp :hunchentoot)
    (:name "parallel" :label "parallel-easy-acceptor" :lisp :parallel)
    (:name "parallel-timer" :label "parallel-easy-acceptor, its wait a deferred reply on its timer"
     :lisp :parallel-timer :waits-only t)
    (:name "aserve" :label "Portable AllegroServe" :lisp :aserve)
    (:name "nginx" :label "nginx, 2 workers" :nginx t))
  "The servers measured, in table and chart order.  The first is the baseline
that every ratio is taken against.  A :LISP server is a kind that SERVE
starts in a process of its own, given its :SERVE-OPTIONS too; :NGINX runs Debian's nginx; a server with
:LAUNCH is started by that function, called as LAUNCH-SERVER is.")

(defparameter *static-files*
  '(("1k.html" . 1024) ("1m.bin" . 1048576))
  "The files of the static workloads, in the folder STATIC-FOLDER makes, and
their sizes.")

(defun workloads (quick)
  "Every workload: handler delay, keep-alive or one request per connection,
concurrency; then each static file, kept alive over 100 connections.
QUICK keeps 100 connections only."
  (append (loop for delay-ms in '(0 1)
                append (loop for close in '(nil t)
                             append (loop for connections in (if quick '(100) '(100 1000))
                                          collect (list :delay-ms delay-ms :close close
                                                        :connections connections))))
          (loop for (file) in *static-files*
                collect (list :delay-ms 0 :close nil :connections 100 :file file))))

(defun workload-name (workload)
  (destructuring-bind (&key delay-ms close connections file) workload
    (if file
        (format nil "static ~A c~D" file connections)
        (format nil "~Dms ~:[keep-alive~;close~] c~D" delay-ms close connections))))

(defun workload-path (workload)
  "The path wrk asks for: the workload's :PATH, the static file under
/static/, or /yo."
  (let ((file (getf workload :file)))
    (cond ((getf workload :path))
          (file (format nil "/static/~A" file))
          (t "/yo"))))

(defun make-static-folder ()
  "A new folder holding *STATIC-FILES*: an HTML page and a binary file, the
same octets for every server.  Its native name, ending with a slash."
  (let ((folder (format nil "~A/" (string-right-trim '(#\Newline)
                                                     (uiop:run-program '("mktemp" "-d") :output :string)))))
    (loop for (file . size) in *static-files*
          do (with-open-file (out (concatenate 'string folder file) :direction :output
                                                                    :element-type '(unsigned-byte 8))
               (let ((octets (make-array size :element-type '(unsigned-byte 8))))
                 (if (search ".html" file)
                     (let* ((start "<!DOCTYPE html><html><head><title>Static</title></head><body>")
                            (end (format nil "</body></html>~%"))
                            (page (concatenate 'string start
                                               (make-string (- size (length start) (length end)) :initial-element #\x)
                                               end)))
                       (replace octets (map 'vector #'char-code page)))
                     (dotimes (index size)
                       (setf (aref octets index) (mod (* index 7) 251))))
                 (write-sequence octets out))))
    ;; mktemp makes it 0700; nginx's workers run as another user.
    (uiop:run-program (list "chmod" "-R" "a+rX" folder))
    folder))

(defvar *static-folder* nil
  "The folder every server of a run serves under /static/.")

(defun workload-file-name (workload)
  (substitute #\_ #\Space (workload-name workload)))

;;; Processes.

(defun free-port ()
  (let ((socket (usocket:socket-listen "127.0.0.1" 0 :reuseaddress t)))
    (prog1 (usocket:get-local-port socket)
      (usocket:socket-close socket))))

(defparameter *nginx-echo-module* "/usr/lib/nginx/modules/ngx_http_echo_module.so"
  "Debian's nginx echo module (libnginx-mod-http-echo), whose echo_sleep
makes the 1 ms workloads' handler wait as the Lisp servers' does.")

(defvar *server-processors* nil
  "The processors each server process runs on, as taskset(1)'s list (say
\"0\"), or NIL for any: the per-core table (bench/per-core.lisp) pins the
servers to one processor and wrk to another.")

(defun pinned-command (command)
  "COMMAND, a list of program and arguments, run on *SERVER-PROCESSORS*
when they are named."
  (if *server-processors*
      (list* "taskset" "-c" *server-processors* command)
      command))

(defun nginx-config-opening (directory &key (workers 2))
  "The start of every nginx.conf of the bench: WORKERS worker processes, no
access log, its files in DIRECTORY, up to the servers of its http block."
  (format nil "worker_processes ~D;
daemon off;
master_process on;
pid ~Anginx.pid;
error_log ~Aerror.log;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path ~A;
  proxy_temp_path ~A;
  fastcgi_temp_path ~A;
  uwsgi_temp_path ~A;
  scgi_temp_path ~A;
" workers directory directory directory directory directory directory directory))

(defun nginx-config (directory port &key upstream-ports (delay-ms 0) (workers 2))
  "nginx.conf for WORKERS workers on PORT, its files in DIRECTORY: answering /yo
itself (after an echo_sleep of DELAY-MS when it is not 0), or, given
UPSTREAM-PORTS, proxying to them as README's configuration does (kept-alive
upstream connections, closed before our keep-alive timeout)."
  (format nil "~:[~*~;load_module ~A;~%~]~A~:[  server {
    listen 127.0.0.1:~D;
    location /yo { default_type text/plain; ~:[return 200 \"Hey!\";~;~:*echo_sleep ~A; echo -n \"Hey!\";~] }
~@[    location /static/ { alias ~A; sendfile on; }~%~]  }~;  upstream lisp {
~{    server 127.0.0.1:~D;~%~}    keepalive 64;
    keepalive_timeout 4s;
  }
  server {
    listen 127.0.0.1:~D;
    location / {
      proxy_pass http://lisp;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
    }
  }~]
}
" (plusp delay-ms) *nginx-echo-module* (nginx-config-opening directory :workers workers)
          upstream-ports (or upstream-ports port)
          (if upstream-ports port (and (plusp delay-ms) (format nil "~,3F" (/ delay-ms 1000))))
          (if upstream-ports port *static-folder*)))

(defun launch-nginx-with (make-config log-file)
  "Start nginx in a directory of its own with the configuration MAKE-CONFIG
returns given that directory's name; its process-info."
  (let* ((directory (format nil "~A/" (string-right-trim
                                      '(#\Newline)
                                      (uiop:run-program '("mktemp" "-d") :output :string))))
         (config (concatenate 'string directory "nginx.conf")))
    (with-open-file (out config :direction :output)
      (write-string (funcall make-config directory) out))
    (uiop:launch-program (pinned-command (list "nginx" "-c" config "-p" directory
                                               "-e" (concatenate 'string directory "error.log")))
                         :output log-file :error-output :output :if-output-exists :supersede)))

(defun launch-nginx (port &key upstream-ports (log-file nil) (delay-ms 0) (workers 2))
  "Start nginx on PORT (see NGINX-CONFIG); its process-info."
  (launch-nginx-with (lambda (directory)
                       (nginx-config directory port :upstream-ports upstream-ports :delay-ms delay-ms
                                                    :workers workers))
                     log-file))

(defun launch-server (server port delay-ms core log-file &key ssl-port ssl-certificate ssl-key ssl-certificates)
  "Start SERVER in a process of its own, from its own :CORE if it has one,
else from CORE, on *SERVER-PROCESSORS*; its process-info.  nginx and Woo
run the server's :WORKERS worker processes or threads (2 unless it says).
SSL-PORT, SSL-CERTIFICATE, SSL-KEY and SSL-CERTIFICATES go to SERVE
(the Lisp servers only)."
  (cond
    ((getf server :nginx)
     (launch-nginx port :log-file log-file :delay-ms delay-ms :workers (getf server :workers 2)))
    ((getf server :peer)
     (launch-peer server port delay-ms log-file :workers (getf server :workers)))
    ((getf server :launch)
     (funcall (getf server :launch) port delay-ms core log-file))
    (t
     (uiop:launch-program
      (pinned-command
       (list "sbcl" "--core" (or (getf server :core) core) "--noinform" "--non-interactive" "--disable-debugger"
             "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench:serve ~S ~D :delay-ms ~D :static-folder ~S~
                                     ~@[ :ssl-port ~D~]~@[ :ssl-certificate ~S~]~@[ :ssl-key ~S~]~
                                     ~@[ :ssl-certificates '~S~]~{ ~S~})"
                              (getf server :lisp) port delay-ms *static-folder*
                              ssl-port (and ssl-certificate (namestring ssl-certificate))
                              (and ssl-key (namestring ssl-key)) ssl-certificates (getf server :serve-options))))
      :output log-file :error-output :output :if-output-exists :supersede))))

(defun stop-server (process)
  "End PROCESS by its PID: TERM, then KILL if it is still there after 2 s."
  (uiop:terminate-process process)
  (loop repeat 20
        while (uiop:process-alive-p process)
        do (sleep 0.1))
  (when (uiop:process-alive-p process)
    (uiop:terminate-process process :urgent t))
  (uiop:wait-process process))

(defun http-get (port path &key (scheme "http"))
  "The body of GET PATH, or NIL when the server does not answer 200.  Over
https, the bench's self-signed certificate is taken as it is."
  (multiple-value-bind (body error-output status)
      (uiop:run-program (list "curl" "-s" "-f" "-k" "--max-time" "5"
                              (format nil "~A://127.0.0.1:~D~A" scheme port path))
                        :output :string :ignore-error-status t)
    (declare (ignore error-output))
    (and (zerop status) body)))

(defun wait-until-serving (port &key (scheme "http"))
  (loop repeat 300
        thereis (equal "Hey!" (http-get port "/yo" :scheme scheme))
        do (sleep 0.1)))

(defun parse-lisp-counters (text)
  "The plist of LISP-COUNTERS from the body TEXT of GET /bench-stats.  The
server of a revision from before 2026-11-27 that bench/run compare
measures adds its peak thread count."
  (destructuring-bind (requests consed &rest older-counts)
      (mapcar #'parse-integer (cl-ppcre:all-matches-as-strings "\\d+" text))
    (declare (ignore older-counts))
    (list :requests requests :consed consed)))

(defun lisp-counters (port)
  "Requests served and bytes consed of a Lisp server, as a plist."
  (let ((text (http-get port "/bench-stats")))
    (and text (parse-lisp-counters text))))

(defun process-cpu-seconds (pid)
  "CPU seconds the process PID has used, all its threads, user and system
time together; second and third values, each apart.  From /proc/PID/stat."
  (let* ((stat (uiop:read-file-string (format nil "/proc/~D/stat" pid)))
         ;; The fields after the command, which is in parentheses and may hold spaces.
         (fields (cl-ppcre:split "\\s+" (subseq stat (+ 2 (position #\) stat :from-end t)))))
         (ticks-per-second (parse-integer (uiop:run-program '("getconf" "CLK_TCK") :output :string)
                                          :junk-allowed t))
         ;; utime and stime are fields 14 and 15 of proc(5)'s stat; FIELDS starts at field 3.
         (user (/ (parse-integer (nth 11 fields)) ticks-per-second))
         (system (/ (parse-integer (nth 12 fields)) ticks-per-second)))
    (values (+ user system) user system)))

(defun child-pids (pid)
  "The running processes that the main thread of process PID started (nginx's
workers), from /proc/PID/task/PID/children."
  (let ((text (ignore-errors (uiop:read-file-string (format nil "/proc/~D/task/~D/children" pid pid)))))
    (and text (mapcar #'parse-integer (cl-ppcre:all-matches-as-strings "\\d+" text)))))

(defun server-processor-seconds (pid)
  "The user and system seconds, as two values, of the server process PID
and the processes it started: nginx's master and its workers together."
  (loop for process in (cons pid (child-pids pid))
        for (nil user system) = (or (ignore-errors (multiple-value-list (process-cpu-seconds process)))
                                    ;; A worker that ended between the listing and the reading.
                                    '(0 0 0))
        sum user into user-seconds
        sum system into system-seconds
        finally (return (values user-seconds system-seconds))))

(defun client-processor-seconds ()
  "The user and system seconds, as two values, of the children of this
process that have ended and been waited for: around one wrk run, that run's."
  (multiple-value-bind (ok user-microseconds system-microseconds) (sb-unix:unix-getrusage sb-unix:rusage_children)
    (declare (ignore ok))
    (values (/ user-microseconds 1000000) (/ system-microseconds 1000000))))

(defun processor-seconds (server-pid)
  "The processor time used so far, in seconds, as a list: the server's user
and system time (the process SERVER-PID and its children), then wrk's user
and system time (this process's children that have ended and been waited
for)."
  (multiple-value-call #'list (server-processor-seconds server-pid) (client-processor-seconds)))

(defun call-timing-processors (server-pid function)
  "Call FUNCTION, which runs one wrk and waits for it.  FUNCTION's values,
then the processor time it took, a list in the order of PROCESSOR-SECONDS.
Server and client share this machine's processors, so requests/s goes as
one over their sum a request: a server can lose requests/s to the time wrk
spends on its replies."
  (let* ((before (processor-seconds server-pid))
         (values (multiple-value-list (funcall function))))
    (values-list (append values (list (mapcar #'- (processor-seconds server-pid) before))))))

(defun microseconds-per-request (processor-seconds requests)
  "PROCESSOR-SECONDS (from CALL-TIMING-PROCESSORS) as microseconds a request
over REQUESTS, as a plist of the matrix's keys; NIL values when no request
was made."
  (loop for key in '(:server-user-us :server-system-us :client-user-us :client-system-us)
        for seconds in processor-seconds
        collect key
        collect (and requests (plusp requests) (/ (* seconds 1000000) requests))))

(defun process-thread-count (pid)
  "The threads of process PID now, from /proc/PID/status, or NIL."
  (ignore-errors
   (with-open-file (status (format nil "/proc/~D/status" pid))
     (loop for line = (read-line status nil)
           while line
           when (and (> (length line) 8) (string= "Threads:" line :end2 8))
             return (parse-integer line :start 8)))))

(defun call-counting-threads (pid function)
  "Call FUNCTION while the threads of process PID are counted every 10 ms
from this process, which costs the measured one nothing.  FUNCTION's value
and the most threads seen."
  (let* ((peak 0)
         (done nil)
         (counter (bt:make-thread (lambda ()
                                    (loop until done
                                          do (let ((threads (process-thread-count pid)))
                                               (when (and threads (> threads peak))
                                                 (setf peak threads)))
                                             (sleep 0.01)))
                                  :name "thread counter")))
    (let ((value (unwind-protect (funcall function)
                   (setf done t)
                   (bt:join-thread counter))))
      (values value peak))))

;;; wrk.

(defun wrk-command (port workload seconds &key (scheme "http"))
  "The wrk command loading SCHEME://127.0.0.1:PORT with WORKLOAD for SECONDS."
  (destructuring-bind (&key close connections cookie &allow-other-keys) workload
    (append (list "wrk" "-t2" (format nil "-c~D" connections) (format nil "-d~Ds" seconds) "--latency")
            (when close (list "-H" "Connection: close"))
            (when cookie (list "-H" (format nil "Cookie: ~A" cookie)))
            (list (format nil "~A://127.0.0.1:~D~A" scheme port (workload-path workload))))))

(defun wrk (port workload seconds &key (scheme "http"))
  "Run wrk on SCHEME://127.0.0.1:PORT for WORKLOAD's path for SECONDS; its whole output."
  (uiop:run-program (wrk-command port workload seconds :scheme scheme)
                    :output :string :error-output :output :ignore-error-status t))

(defun latency-ms (text percentile)
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings
                             (format nil "(?m)^\\s+~D%\\s+([\\d.]+)(us|ms|s)" percentile) text))))
    (when match
      (* (let ((*read-default-float-format* 'double-float))
           (read-from-string (aref match 0)))
         (cdr (assoc (aref match 1) '(("us" . 1/1000) ("ms" . 1) ("s" . 1000)) :test #'string=))))))

(defun scan-number (regex text &optional (default 0))
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings regex text))))
    (if match
        (let ((*read-default-float-format* 'double-float))
          (read-from-string (aref match 0)))
        default)))

(defun parse-wrk (text)
  (let ((errors (nth-value 1 (cl-ppcre:scan-to-strings
                              "Socket errors: connect (\\d+), read (\\d+), write (\\d+), timeout (\\d+)"
                              text))))
    (list :requests-per-second (scan-number "Requests/sec:\\s+([\\d.]+)" text)
          :requests (scan-number "(\\d+) requests in" text)
          :p50-ms (latency-ms text 50)
          :p99-ms (latency-ms text 99)
          :connect-errors (if errors (parse-integer (aref errors 0)) 0)
          :read-errors (if errors (parse-integer (aref errors 1)) 0)
          :write-errors (if errors (parse-integer (aref errors 2)) 0)
          :timeout-errors (if errors (parse-integer (aref errors 3)) 0)
          :non-2xx (scan-number "Non-2xx or 3xx responses: (\\d+)" text))))

;;; One cell.

(defun measure-cell (server workload &key seconds warm-seconds core directory (round 1))
  "Start SERVER, check it, warm it, measure WORKLOAD, stop it.  A plist:
wrk's figures, or :FAILED when the server did not answer or ended before
it was stopped (SERVER-ENDED-FAILURE)."
  (let* ((port (free-port))
         (base (format nil "~Araw/~A_~A_round~D" directory (getf server :name)
                       (workload-file-name workload) round))
         (log-file (concatenate 'string base ".server.log"))
         (process (launch-server server port (getf workload :delay-ms) core log-file)))
    (unwind-protect
         (if (not (wait-until-serving port))
             (list :failed "server did not answer GET /yo within 30 s")
             (let ((lisp (getf server :lisp)))
               (wrk port workload warm-seconds)
               (let ((before (and lisp (lisp-counters port)))
                     (pid (uiop:process-info-pid process)))
                 (multiple-value-bind (output peak-threads processor-seconds)
                     (call-timing-processors pid (lambda ()
                                                   (call-counting-threads pid (lambda () (wrk port workload seconds)))))
                   (let* ((after (and lisp (lisp-counters port)))
                          (served (and before after (- (getf after :requests) (getf before :requests))))
                          (cell (parse-wrk output)))
                     (with-open-file (out (concatenate 'string base ".wrk.txt") :direction :output
                                                                                 :if-exists :supersede)
                       (write-string output out))
                     (if (not (uiop:process-alive-p process))
                         (server-ended-failure log-file)
                         (append cell
                                 (microseconds-per-request processor-seconds (getf cell :requests))
                                 (list :bytes-consed-per-request
                                       (and served (plusp served)
                                            (round (- (getf after :consed) (getf before :consed)) served))
                                       :peak-threads (and lisp peak-threads)))))))))
      (stop-server process))))

(defun server-ended-failure (log-file)
  "The figures of a measurement whose server process ended before it was
stopped: :FAILED with the first line of its LOG-FILE (a Lisp server's
unhandled error).  wrk, refused, counts no error, and the cell would read
as 0 requests/s."
  (list :failed (format nil "the server ended during the measurement: ~A"
                        (or (ignore-errors (first (uiop:read-file-lines log-file))) "no log"))))

;;; Output.

(defun utc-timestamp ()
  (multiple-value-bind (second minute hour day month year) (decode-universal-time (get-universal-time) 0)
    (format nil "~4,'0D-~2,'0D-~2,'0DT~2,'0D~2,'0D~2,'0DZ" year month day hour minute second)))

(defun shell-line (command)
  (string-right-trim '(#\Newline)
                     (uiop:run-program (list "bash" "-c" command) :output :string
                                                                  :ignore-error-status t)))

(defun write-system-info (file)
  (with-open-file (out file :direction :output :if-exists :supersede)
    (format out "date: ~A~%" (shell-line "date -u '+%Y-%m-%d %H:%M:%S UTC'"))
    (format out "cpu: ~A~%" (shell-line "lscpu | sed -n 's/^Model name:[[:space:]]*//p'"))
    (format out "cores: ~A~%" (shell-line "nproc"))
    (format out "kernel: ~A~%" (shell-line "uname -srm"))
    (format out "sbcl: ~A~%" (shell-line "sbcl --version"))
    (format out "packages:~%~A~%"
            (shell-line "dpkg-query -W cl-hunchentoot cl-usocket cl-bordeaux-threads cl-aserve nginx-light wrk 2>/dev/null | sed 's/^/  /'"))
    (format out "commit: ~A~%" (shell-line "git rev-parse HEAD 2>/dev/null && git status --porcelain --untracked-files=no | grep -q . && echo '(with uncommitted changes)'"))))

(defun ratio-to (value baseline)
  (and value baseline (plusp baseline) (/ value baseline)))

(defun ratio-text (ratio)
  "Two decimals, or three significant ones below 0.1, so small ratios do not read as zero."
  (let ((ratio (float ratio 1d0)))
    (if (< ratio 0.1d0)
        (format nil "~,3F" ratio)
        (format nil "~,2F" ratio))))

(defparameter *bar-colours* '("#7f7f7f" "#1f77b4" "#2ca02c" "#d62728" "#ff7f0e" "#9467bd" "#8c564b")
  "Bar colour of each server, in *SERVERS* order.")

(defun csv-field (value)
  (typecase value
    (null "")
    (float (format nil "~,3F" value))
    (ratio (format nil "~,3F" (float value 1d0)))
    (t (princ-to-string value))))

(defparameter *csv-keys*
  '(:requests-per-second :p50-ms :p99-ms :connect-errors :read-errors :write-errors
    :timeout-errors :non-2xx :bytes-consed-per-request :peak-threads
    :server-user-us :server-system-us :client-user-us :client-system-us))

(defun rounds-field (cell)
  "Every round's requests/s of CELL, space-separated."
  (format nil "~{~,0F~^ ~}" (getf cell :rounds)))

(defun write-csv (file results)
  "RESULTS: list of (server workload plist ratio)."
  (with-open-file (out file :direction :output :if-exists :supersede)
    (format out "server,handler_ms,connection,connections,path,~{~(~A~)~^,~},ratio_to_baseline,rounds_requests_per_second,failure~%"
            (mapcar (lambda (key) (substitute #\_ #\- (string key))) *csv-keys*))
    (loop for (server workload cell ratio) in results
          do (format out "~A,~D,~:[keep-alive~;close~],~D,~A,~{~A~^,~},~A,~A,~A~%"
                     (getf server :name) (getf workload :delay-ms) (getf workload :close)
                     (getf workload :connections) (workload-path workload)
                     (mapcar (lambda (key) (csv-field (getf cell key))) *csv-keys*)
                     (csv-field ratio) (rounds-field cell) (or (getf cell :failed) "")))))

(defun write-chart (directory results workloads key title file-stem baseline-cells)
  "A clustered bar chart of KEY, one cluster per workload, one bar per
server, labelled with the ratio to the baseline; SVG and PNG via gnuplot."
  (let ((data-file (format nil "~A~A.dat" directory file-stem))
        (script-file (format nil "~A~A.gp" directory file-stem))
        (server-count (length *servers*)))
    (with-open-file (out data-file :direction :output :if-exists :supersede)
      (loop for workload in workloads
            for index from 0
            do (format out "~D \"~A\"" index (workload-name workload))
               (dolist (server *servers*)
                 (let* ((cell (third (find-if (lambda (result) (and (eq (first result) server)
                                                                    (equal (second result) workload)))
                                              results)))
                        (value (getf cell key))
                        (base (getf (gethash workload baseline-cells) key)))
                   (format out " ~A ~A"
                           (if (and value (plusp value)) (csv-field (float value 1d0)) "NaN")
                           (let ((ratio (ratio-to value base)))
                             (if ratio (format nil "\"~Ax\"" (ratio-text ratio)) "\"\"")))))
               (terpri out)))
    (with-open-file (out script-file :direction :output :if-exists :supersede)
      (format out "set title \"~A\"
set style fill solid 0.85 border -1
set logscale y
set grid ytics
set key outside bottom center horizontal
set xtics rotate by -20 scale 0
set xrange [-0.6:~D]
bw = ~F
~{~A~%~}"
              title (- (length workloads) 0.4) (/ 0.8 server-count)
              (loop for (terminal extension) in '(("svg size 1400,700 dynamic font 'sans,11'" "svg")
                                                  ("pngcairo size 1400,700 font 'sans,10'" "png"))
                    collect (format nil "set terminal ~A~%set output \"~A~A.~A\"~%plot ~{~A~^, \\~%     ~}"
                                    terminal directory file-stem extension
                                    (loop for server in *servers*
                                          for i from 0
                                          for value-column = (+ 3 (* 2 i))
                                          for offset = (* (- i (/ (1- server-count) 2)) (/ 0.8 server-count))
                                          collect (format nil "\"~A\" using ($1+~F):~D:(bw)~:[~;:xtic(2)~] with boxes lc rgb \"~A\" title \"~A\""
                                                          data-file (float offset) value-column (zerop i)
                                                          (nth (mod i (length *bar-colours*)) *bar-colours*)
                                                          (getf server :label))
                                          collect (format nil "\"~A\" using ($1+~F):~D:~D with labels offset 0,0.7 font ',8' notitle"
                                                          data-file (float offset) value-column (1+ value-column)))))))
    (uiop:run-program (list "gnuplot" script-file) :ignore-error-status t :error-output :output
                                                   :output *standard-output*)))

(defun workload-table (results workloads cell-text)
  "Markdown: one row per workload, one column per server of *SERVERS*; each
column's text is CELL-TEXT's of the server's cell of RESULTS and the
workload, \"-\" where the server was not measured on it."
  (with-output-to-string (out)
    (format out "| workload |~{ ~A |~}~%|---|~{~A~}~%"
            (mapcar (lambda (server) (getf server :name)) *servers*)
            (mapcar (constantly "---:|") *servers*))
    (dolist (workload workloads)
      (format out "| ~A |" (workload-name workload))
      (dolist (server *servers*)
        (let ((result (find-if (lambda (result) (and (eq (first result) server)
                                                     (equal (second result) workload)))
                               results)))
          (format out " ~A |" (if result (funcall cell-text (third result) workload) "-"))))
      (terpri out))))

(defun summary-table (results workloads baseline-cells)
  "Markdown: one row per workload, each server's requests/s ratio to the baseline."
  (workload-table results workloads
                  (lambda (cell workload)
                    (let* ((value (getf cell :requests-per-second))
                           (ratio (ratio-to value (getf (gethash workload baseline-cells) :requests-per-second))))
                      (cond ((null (gethash workload baseline-cells)) (format nil "~D/s" (and value (round value))))
                            (ratio (format nil "~Ax (~D/s)" (ratio-text ratio) (round value)))
                            (t "failed"))))))

(defun processor-time-table (results workloads)
  "Markdown: one row per workload, for each server the processor time a
request of its median round, in microseconds: the server's user + system
time, then wrk's, user and system together."
  (workload-table results workloads
                  (lambda (cell workload)
                    (declare (ignore workload))
                    (destructuring-bind (&key server-user-us server-system-us client-user-us client-system-us
                                         &allow-other-keys)
                        cell
                      (if (and server-user-us server-system-us client-user-us client-system-us)
                          (format nil "~,1F + ~,1F, wrk ~,1F" server-user-us server-system-us
                                  (+ client-user-us client-system-us))
                          "-")))))

(defun server-cells (results server-name)
  "Workload -> the cell of the server named SERVER-NAME in RESULTS."
  (let ((cells (make-hash-table :test #'equal)))
    (loop for (server workload cell) in results
          when (equal (getf server :name) server-name)
            do (setf (gethash workload cells) cell))
    cells))

(defun duration-text (seconds)
  (multiple-value-bind (minutes seconds) (floor (round seconds) 60)
    (format nil "~Dm~2,'0Ds" minutes seconds)))

(defun write-suite-report (report name directory)
  "Print REPORT, a suite's; with DIRECTORY (a matrix run's) append it to its
summary.md and write NAME.md there, else write
bench/results/<UTC timestamp>-NAME.md."
  (format t "~&~%~A" report)
  (if directory
      (progn
        (with-open-file (out (merge-pathnames "summary.md" directory) :direction :output :if-exists :append)
          (format out "~%~A" report))
        (with-open-file (out (merge-pathnames (format nil "~A.md" name) directory) :direction :output
                                                                                  :if-exists :supersede)
          (write-string report out)))
      (let ((file (format nil "bench/results/~A-~A.md" (utc-timestamp) name)))
        (with-open-file (out file :direction :output :if-exists :supersede)
          (write-string report out))
        (format t "~&Report: ~A~%" file))))

(defun median-cell (cells)
  "Of one server's cells for one workload (one per round), the one with the
median requests/s, carrying every round's requests/s as :ROUNDS."
  (let* ((measured (remove-if (lambda (cell) (getf cell :failed)) cells))
         (sorted (sort (copy-list measured) #'< :key (lambda (cell) (getf cell :requests-per-second)))))
    (if sorted
        (list* :rounds (mapcar (lambda (cell) (getf cell :requests-per-second)) measured)
               (nth (floor (1- (length sorted)) 2) sorted))
        (first cells))))

(defun measure-every-cell (cells measured &key seconds warm-seconds rounds core directory)
  "Measure each (SERVER WORKLOAD ROUND) of CELLS in turn, printing progress,
and push each result on MEASURED under (server name, workload)."
  (let ((start-time (get-internal-real-time)))
    (loop for (server workload round) in cells
          for step from 1
          for cells-left = (- (length cells) step -1)
          for seconds-per-cell = (if (= step 1)
                                     (+ seconds warm-seconds 3)
                                     (/ (- (get-internal-real-time) start-time)
                                        internal-time-units-per-second (1- step)))
          do (format t "~&[~D/~D] ~A, ~A, round ~D of ~D: measuring ~D s (about ~A left)~%"
                     step (length cells) (getf server :name) (workload-name workload) round rounds
                     seconds (duration-text (* cells-left seconds-per-cell)))
             (finish-output)
             (let ((cell (measure-cell server workload :seconds seconds :warm-seconds warm-seconds
                                                       :core core :directory directory :round round)))
               (when (getf cell :failed)
                 (format t "~&  failed: ~A~%" (getf cell :failed)))
               (push cell (gethash (list (getf server :name) workload) measured))))))

(defun run-benchmarks (&key quick core (servers *servers*) (peers t) (workloads (workloads quick))
                            (rounds (if quick 1 5)) (seconds (if quick 2 5))
                            (output-root "bench/results/") (run-name (utc-timestamp)))
  "Measure every server of SERVERS on every workload, ROUNDS times in turn
(round by round, so that a slow minute of the machine hits every server),
and keep each cell's median round; write the results directory and print
the ratio tables.  With PEERS, the peers of *PEERS* whose sources are there
are measured too, on the handler workloads.  QUICK: one round of 2 s cells,
100 connections only.  Returns the directory."
  (let* ((peer-directory (format nil "~A/" (string-right-trim '(#\Newline)
                                                              (uiop:run-program '("mktemp" "-d") :output :string))))
         (*servers* (append servers
                            (when peers
                              (announce-missing-peers)
                              (remove nil (mapcar (lambda (peer) (build-peer-core peer peer-directory))
                                                  (available-peers))))))
         (*static-folder* (make-static-folder))
         (warm-seconds 2)
         (directory (format nil "~A~A/" output-root run-name))
         (cells (loop for workload in workloads
                      append (loop for round from 1 to rounds
                                   append (loop for server in *servers*
                                                when (measures-workload-p server workload)
                                                  collect (list server workload round)))))
         (measured (make-hash-table :test #'equal))
         (results '())
         (baseline-cells (make-hash-table :test #'equal)))
    (ensure-directories-exist (concatenate 'string directory "raw/"))
    (write-system-info (concatenate 'string directory "system-info.txt"))
    (unwind-protect (measure-every-cell cells measured :seconds seconds :warm-seconds warm-seconds
                                                       :rounds rounds :core core :directory directory)
      (uiop:run-program (list "rm" "-rf" *static-folder* peer-directory)))
    (dolist (workload workloads)
      (dolist (server *servers*)
        (when (measures-workload-p server workload)
          (let ((cell (median-cell (gethash (list (getf server :name) workload) measured))))
            (when (eq server (first *servers*))
              (setf (gethash workload baseline-cells) cell))
            (push (list server workload cell
                        (ratio-to (getf cell :requests-per-second)
                                  (getf (gethash workload baseline-cells) :requests-per-second)))
                  results)))))
    (setf results (nreverse results))
    (write-csv (concatenate 'string directory "results.csv") results)
    (let ((baseline (getf (first *servers*) :label)))
      (write-chart directory results workloads :requests-per-second
                   (format nil "Requests/s (log scale); labels: ratio to ~A" baseline)
                   "requests-per-second" baseline-cells)
      (write-chart directory results workloads :p99-ms
                   (format nil "p99 latency, ms (log scale, lower is better); labels: ratio to ~A" baseline)
                   "p99-latency" baseline-cells))
    (let ((table (summary-table results workloads baseline-cells)))
      (with-open-file (out (concatenate 'string directory "summary.md") :direction :output)
        (format out "Requests/s, the median of ~D round~:P of ~D s per cell, as a ratio to ~A in this run:~%~%~A"
                rounds seconds (getf (first *servers*) :name) table)
        (dolist (reference '("woo" "nginx"))
          (let ((cells (server-cells results reference)))
            (when (plusp (hash-table-count cells))
              (format out "~%The same, as a fraction of ~A in this run:~%~%~A"
                      reference (summary-table results workloads cells)))))
        (format out "~%Processor time a request, microseconds, in each cell's median round: the server's ~
                     user + system time (nginx's: its master's and its workers'), then wrk's, user and ~
                     system together.  Server and wrk share this machine's processors, so requests/s goes ~
                     as one over their sum.~%~%~A"
                (processor-time-table results workloads))
        (let ((missing (set-difference *peers* (available-peers))))
          (when missing
            (format out "~%Not measured (sources not in ~A): ~{~A~^, ~}.~%"
                    (namestring (vendor-directory)) (mapcar (lambda (peer) (getf peer :label)) missing)))))
      (format t "~&~%Requests/s (median of ~D round~:P), ratio to ~A in this run (~A):~%~A~%Results: ~A~%"
              rounds (getf (first *servers*) :name) directory table directory))
    directory))

(defun run-comparison (&key revision revision-core quick rounds workload-name core)
  "The matrix for Hunchentoot, ours as built at REVISION (a git revision,
its bench core REVISION-CORE) and ours as checked out, round by round in
one run, so that a change is judged by ratios measured side by side rather
than against a run made when the machine was faster or slower.  ROUNDS
(default as for RUN-BENCHMARKS) and WORKLOAD-NAME (one workload, named as
in the summary, say \"1ms keep-alive c100\"; default every one) let a
doubtful cell be measured again, longer.  Writes
bench/results/<UTC timestamp>-compare-<REVISION>/.  Returns the directory."
  (let ((workloads (workloads quick)))
    (when workload-name
      (setf workloads (remove workload-name workloads :key #'workload-name :test-not #'string=))
      (unless workloads
        (error "No workload is named ~S; they are ~{~S~^, ~}."
               workload-name (mapcar #'workload-name (workloads nil)))))
    (run-benchmarks :quick quick :core core :workloads workloads
                    :rounds (or rounds (if quick 1 3))
                    :run-name (format nil "~A-compare-~A" (utc-timestamp) revision) :peers nil
                    :servers (list (first *servers*)
                                   (list :name revision :label (format nil "parallel-easy-acceptor at ~A" revision)
                                         :lisp :parallel :core revision-core)
                                   (find "parallel" *servers* :key (lambda (server) (getf server :name))
                                                              :test #'string=)))))

(defun run-waits (&key (rounds 3) core)
  "The workloads whose handler waits 1 ms, for Hunchentoot, ours with a
handler that sleeps, ours with its reply deferred and completed by its
timer, and nginx's echo_sleep, side by side in one run.  Writes
bench/results/<UTC timestamp>-waits/.  Returns the directory."
  (run-benchmarks :core core :peers nil :rounds rounds
                  :workloads (remove-if-not #'plusp (workloads nil) :key (lambda (workload) (getf workload :delay-ms)))
                  :run-name (format nil "~A-waits" (utc-timestamp))
                  :servers (remove-if (lambda (server) (equal (getf server :name) "aserve")) *servers*)))
