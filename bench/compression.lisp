;;;; Compressed replies: a 10 KiB HTML page, kept alive over 100
;;;; connections, the client offering gzip: ours coding it at gzip's level
;;;; 1 against nginx's gzip filter at gzip_comp_level 1 (the page a file of
;;;; its, coded at each request), then ours with zstd and with br, and ours
;;;; and nginx sending it as it is.  `bench/run compression [SECONDS
;;;; [ROUNDS]]`; make bench ends with it.

(in-package #:hunchentoot-recycling-taskmaster-bench)

(defparameter *compression-cells*
  ;; SERVE's keyword arguments are printed into a form: the list quoted.
  '((:name "ours, gzip 1" :lisp :parallel :serve-options (:compression '((:gzip 1))) :accept "gzip")
    (:name "nginx, gzip 1" :nginx-gzip t :accept "gzip")
    (:name "ours, zstd 3" :lisp :parallel :serve-options (:compression '((:zstd 3))) :accept "zstd")
    (:name "ours, br 4" :lisp :parallel :serve-options (:compression '((:br 4))) :accept "br")
    (:name "ours, not coded" :lisp :parallel :accept "gzip")
    (:name "nginx, not coded" :nginx-gzip nil :accept "gzip"))
  "Each cell: the server, and what the client offers.")

(defparameter *compression-target* 0.6
  "Ours coding with gzip, as a fraction of nginx coding with gzip: at least this.")

(defun nginx-compression-config (directory port gzip)
  "nginx.conf for 2 workers sending DIRECTORY's lorem.html at /lorem on
PORT, coded by its gzip filter at level 1 when GZIP, and /yo, which
WAIT-UNTIL-SERVING asks."
  (format nil "~A  server {
    listen 127.0.0.1:~D;
    location = /yo { default_type text/plain; return 200 \"Hey!\"; }
    location = /lorem { default_type text/html; alias ~Alorem.html; ~:[~;gzip on; gzip_comp_level 1; gzip_min_length 256; gzip_vary on;~] }
  }
}
" (nginx-config-opening directory) port directory gzip))

(defun launch-compression-server (cell port core log-file)
  (if (loop for key in cell by #'cddr thereis (eq key :nginx-gzip))
      (launch-nginx-with (lambda (directory)
                           (with-open-file (out (concatenate 'string directory "lorem.html") :direction :output)
                             (write-string *lorem-page* out))
                           (nginx-compression-config directory port (getf cell :nginx-gzip)))
                         log-file)
      (launch-server cell port 0 core log-file)))

(defun compression-wrk (port accept seconds)
  (parse-wrk (uiop:run-program (list "wrk" "-t2" "-c100" (format nil "-d~Ds" seconds) "--latency"
                                     "-H" (format nil "Accept-Encoding: ~A" accept)
                                     (format nil "http://127.0.0.1:~D/lorem" port))
                               :output :string :error-output :output :ignore-error-status t)))

(defun coded-reply-octets (port accept)
  "The Content-Encoding and length of /lorem on PORT offered ACCEPT."
  (let* ((output (uiop:run-program (list "curl" "-s" "-o" "/dev/null" "-H" (format nil "Accept-Encoding: ~A" accept)
                                         "-w" "%header{content-encoding} %{size_download}"
                                         (format nil "http://127.0.0.1:~D/lorem" port))
                                   :output :string :ignore-error-status t))
         (space (position #\Space output :from-end t)))
    (values (string-trim " " (subseq output 0 space)) (parse-integer output :start (1+ space) :junk-allowed t))))

(defun measure-compression-cell (cell seconds core directory round)
  (let* ((port (free-port))
         (process (launch-compression-server cell port core
                                             (format nil "~Acompression-~D-round~D.log" directory
                                                     (position cell *compression-cells*) round))))
    (unwind-protect
         (if (wait-until-serving port)
             (multiple-value-bind (coding octets) (coded-reply-octets port (getf cell :accept))
               (compression-wrk port (getf cell :accept) 1)
               (list* :coding coding :octets octets (compression-wrk port (getf cell :accept) seconds)))
             (list :failed "server did not answer within 30 s"))
      (stop-server process))))

(defun compression-report (results rounds seconds)
  "The Markdown report of RESULTS, (cell . figures) of every round."
  (flet ((median-of (cell) (median-cell (loop for (c . figures) in results when (eq c cell) collect figures))))
    (let ((nginx (getf (median-of (second *compression-cells*)) :requests-per-second))
          (ours (getf (median-of (first *compression-cells*)) :requests-per-second)))
      (with-output-to-string (out)
        (format out "## Compressed replies~%~%GET /lorem, 10 KiB of HTML, wrk -t2 -c100 kept alive, ~D s a round, ~
                     median of ~D rounds, Accept-Encoding as listed~%~%~
                     | server | offered | coding | octets | requests/s | ratio to nginx gzip | p99 ms | errors |~%~
                     |---|---|---|---:|---:|---:|---:|---:|~%" seconds rounds)
        (dolist (cell *compression-cells*)
          (let* ((figures (median-of cell))
                 (rate (getf figures :requests-per-second))
                 (coding (getf figures :coding)))
            (format out "| ~A | ~A | ~A | ~:[-~;~:*~D~] | ~:[-~;~:*~D~] | ~A | ~:[-~;~:*~,2F~] | ~D~@[ (~A)~] |~%"
                    (getf cell :name) (getf cell :accept) (if (plusp (length coding)) coding "none")
                    (getf figures :octets) (and rate (round rate))
                    (if (and rate nginx (plusp nginx)) (ratio-text (/ rate nginx)) "-")
                    (getf figures :p99-ms) (https-cell-errors figures) (getf figures :failed))))
        (format out "~%Ours with gzip 1 as a fraction of nginx with gzip 1: ~A (target ~,2F: ~A)~%"
                (if (and ours nginx (plusp nginx)) (ratio-text (/ ours nginx)) "-") *compression-target*
                (if (and ours nginx (plusp nginx) (>= (/ ours nginx) *compression-target*)) "ok" "below"))))))

(defun run-compression (&key core (rounds 3) (seconds 5) directory)
  "Measure *COMPRESSION-CELLS*, ROUNDS rounds of SECONDS in turn, and write
the report (WRITE-SUITE-REPORT, compression.md).  True when every cell of
ours answered without an error."
  (let* ((work (format nil "~A/" (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (results (unwind-protect
                       (loop for round from 1 to rounds
                             append (loop for cell in *compression-cells*
                                          collect (cons cell (measure-compression-cell cell seconds core work round))))
                    (uiop:delete-directory-tree (uiop:ensure-directory-pathname work) :validate t
                                                                                      :if-does-not-exist :ignore))))
    (write-suite-report (compression-report results rounds seconds) "compression" directory)
    (loop for (cell . figures) in results
          always (or (not (getf cell :lisp))
                     (and (not (getf figures :failed)) (zerop (https-cell-errors figures)))))))
